#!/usr/bin/env bash
# Sets up, exports the embedded SmolLM2-135M once (int4, into ~/.cache/ruvllm), and asks it a question.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
HF_HUB_OFFLINE=1 $PY -m runtime generate --chat "${1:-What is the capital of France?}" --temperature 0
