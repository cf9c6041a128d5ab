#!/usr/bin/env bash
# Sets up and runs every test (slow ones included), offline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
$PY -m ruff check exporter runtime wasm tests benchmarks
HF_HUB_OFFLINE=1 $PY -m pytest -q --durations=25 "$@"
