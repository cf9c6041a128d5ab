.PHONY: setup test demo web serve lint bench bench-browser
setup:
	bash scripts/setup.sh
test:
	bash scripts/test.sh
demo:
	bash scripts/demo.sh
web:
	HF_HUB_OFFLINE=1 python3 -m wasm build
serve:
	python3 -m wasm serve
lint:
	python3 -m ruff check exporter runtime wasm tests benchmarks
bench:
	HF_HUB_OFFLINE=1 python3 -m runtime bench --json
bench-browser:
	HF_HUB_OFFLINE=1 python3 benchmarks/browser.py
