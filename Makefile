.PHONY: setup test demo lint bench
setup:
	bash scripts/setup.sh
test:
	bash scripts/test.sh
demo:
	bash scripts/demo.sh
lint:
	python3 -m ruff check exporter runtime tests
bench:
	HF_HUB_OFFLINE=1 python3 -m runtime bench --json
