#!/usr/bin/env bash
# Sets up and runs every test (slow ones included), offline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
$PY -m ruff check exporter runtime wasm tests benchmarks
# Two workers (pytest-xdist), a test file each at a time: the session's costly fixtures are made once for both
# (tests/conftest.py); RUVLLM_TEST_WORKERS=0 runs in one process.
HF_HUB_OFFLINE=1 $PY -m pytest -q -n "${RUVLLM_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
