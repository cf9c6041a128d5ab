"""WebGPU, for correctness only: headless Chromium offers just SwiftShader (~0.1 tok/s), never a speed check."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.web.conftest import CHAT, LOAD_ENGINE, OfflinePage, launch, publish

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpu_browser(playwright):
    b = launch(playwright, "--enable-unsafe-webgpu")
    yield b
    b.close()


def test_webgpu_greedy_tokens_equal_native(gpu_browser, site, tiny_package, web_models):
    """A --target wasm package: the page on WebGPU runs its WebGPU graph (K/V written by ScatterND),
    native runs its main graph (TensorScatter); fp32 on both sides, so the tokens are equal."""
    package = tiny_package("llama", "fp32", "wasm")
    url = publish(web_models, package, "tiny-llama-fp32-wasm")
    p = OfflinePage(gpu_browser, site)
    try:
        p.api()
        assert p.evaluate("(async () => !!(navigator.gpu && await navigator.gpu.requestAdapter()))()")
        info = p.evaluate(LOAD_ENGINE, [url, {"device": "auto"}])
        assert info["device"] == "webgpu"  # auto picks the adapter when there is one
        assert info["graph"] == "model_webgpu.onnx"
        text = "Hello! Tell me about the sea."
        reply = p.evaluate(CHAT, {"messages": [{"role": "user", "content": text}], "max_tokens": 6,
                                  "temperature": 0, "return_token_ids": True})
        proc = run_cli("generate", str(package), text, "--chat", "--json", "--temperature", "0",
                       "--max-tokens", "6")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert reply["choices"][0]["token_ids"] == json.loads(proc.stdout)["token_ids"]
        assert not p.off_origin
    finally:
        p.close()
