#!/usr/bin/env bash
# Sets up, asks the embedded SmolLM2-135M a question natively, then builds the offline browser
# bundle (dist/web/) and serves the chat demo at http://127.0.0.1:${PORT:-8000}/ (Ctrl-C stops it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
HF_HUB_OFFLINE=1 $PY -m runtime generate "${1:-Name the capital of France.}" --temperature 0
HF_HUB_OFFLINE=1 $PY -m wasm build
exec $PY -m wasm serve --port "${PORT:-8000}"
