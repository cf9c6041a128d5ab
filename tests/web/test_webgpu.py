"""WebGPU, for correctness only: headless Chromium offers just SwiftShader (a CPU behind the WebGPU API),
never a speed check. The GPU holds the package's weights at their own bits (MatMulNBits, fp32 accumulation)."""

from __future__ import annotations

import collections
import json

import onnx
import pytest

from tests.conftest import external_refs, run_cli
from tests.web.conftest import CHAT, LOAD_ENGINE, LOAD_TIMEOUT_MS, OfflinePage, launch, pages_on, publish

pytestmark = pytest.mark.slow

SMOL = "/models/smollm2-135m/"
SEA = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def gpu_browser(playwright):
    b = launch(playwright, "--enable-unsafe-webgpu")
    yield b
    b.close()


def api_with_gpu(p: OfflinePage, api: bool = True) -> None:
    if api:
        p.api()
        assert p.evaluate("(async () => !!(navigator.gpu && await navigator.gpu.requestAdapter()))()")


@pytest.fixture
def gpu_page(gpu_browser, site):
    """offline_page on a browser with a WebGPU adapter; gpu_page() opens the API page, gpu_page(api=False) none."""
    yield from pages_on(gpu_browser, site, api_with_gpu)


def native_steps(package, messages, max_tokens: int, adapter=None):
    """The native engine's greedy tokens on the same package (with a PEFT adapter), each step's top logprobs."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    engine = Engine.from_package(package, verify=False, speculative_tokens=0)
    model = None
    if adapter is not None:
        engine.adapters.add("mine", adapter)
        model = "mine"
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)
    return [lp for o in engine.generate(messages=messages, params=params, adapter=model) for lp in o.logprobs]


def assert_equal_up_to_a_near_tie(got: list[int], steps, least: int) -> None:
    """Equal to the native tokens until they part, if they do, and then only at a near tie of the native
    engine's (the page's token within 0.05 nats of its best): the same weights, summed in another order."""
    want = [s.token_id for s in steps]
    parted = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert parted >= least, (parted, got, want)
    if parted < min(len(got), len(want)):
        top = dict(steps[parted].top)
        assert got[parted] in top and top[want[parted]] - top[got[parted]] < 0.05, (parted, got, steps[parted])


def test_webgpu_greedy_tokens_equal_native(gpu_page, tiny_package, web_models):
    """A --target wasm package: the page on WebGPU runs its WebGPU graph (K/V written by ScatterND),
    native runs its main graph (TensorScatter); fp32 on both sides, so the tokens are equal."""
    package = tiny_package("llama", "fp32", "wasm")
    url = publish(web_models, package, "tiny-llama-fp32-wasm")
    p = gpu_page()
    # auto passes over a software adapter (SwiftShader is a CPU behind the WebGPU API): WASM
    assert p.evaluate(LOAD_ENGINE, [url, {"device": "auto"}])["device"] == "wasm"
    p.evaluate("async () => await window.engine.unload()")
    info = p.evaluate(LOAD_ENGINE, [url, {"device": "webgpu"}])
    assert (info["device"], info["graph"]) == ("webgpu", "model_webgpu.onnx"), info
    text = "Hello! Tell me about the sea."
    reply = p.evaluate(CHAT, {"messages": [{"role": "user", "content": text}], "max_tokens": 6,
                              "temperature": 0, "return_token_ids": True})
    proc = run_cli("generate", str(package), text, "--chat", "--json", "--temperature", "0",
                   "--max-tokens", "6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert reply["choices"][0]["token_ids"] == json.loads(proc.stdout)["token_ids"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's tiny config ties the embeddings
def test_webgpu_computes_on_the_int4_blocks(arch, gpu_page, tiny_package, web_models):
    """An int4 --target wasm package on WebGPU: its WebGPU graph runs MatMulNBits over the package's blocks
    (no DequantizeLinear, so no fp32 copy of a weight), read from the very bytes the WASM graph reads (the
    shared file holds them once); a tied embedding gathers its rows from the head's blocks. Greedy tokens
    equal the native engine's on the same package up to a near tie, and structured output holds on it."""
    package = tiny_package(arch, "int4", "wasm")
    manifest = json.loads((package / "manifest.json").read_text())
    gpu = onnx.load(package / "model_webgpu.onnx", load_external_data=False).graph
    cpu = onnx.load(package / "model.onnx", load_external_data=False).graph
    ops = collections.Counter(n.op_type for n in gpu.node)
    assert ops["MatMulNBits"] == 4 * manifest["config"]["num_layers"] + 1 and "DequantizeLinear" not in ops, ops
    assert ops["GatherBlockQuantized"] == (1 if manifest["config"]["tie_word_embeddings"] else 0), ops
    big = external_refs(gpu)
    assert big and all(external_refs(cpu).get(name) == ref for name, ref in big.items())  # one copy in the file
    assert manifest["quantization"]["webgpu"] == {"op": "MatMulNBits", "compute": "fp32",
                                                  "dequantized": "in the shader"}
    url = publish(web_models, package, f"tiny-{arch}-int4-wasm")
    p = gpu_page()
    info = p.evaluate(LOAD_ENGINE, [url, {"device": "webgpu"}])
    assert (info["device"], info["graph"]) == ("webgpu", "model_webgpu.onnx"), info
    reply = p.evaluate(CHAT, {"messages": SEA, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert_equal_up_to_a_near_tie(reply["choices"][0]["token_ids"], native_steps(package, SEA, 8), 4)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    reply = p.evaluate(CHAT, {"messages": SEA, "max_tokens": 24, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    choice = reply["choices"][0]
    if choice["finish_reason"] == "stop":  # a random model may run out of tokens inside a long number
        assert set(json.loads(choice["message"]["content"])) == {"n"}
    else:
        assert choice["message"]["content"].startswith('{"n":'), choice


def test_smollm2_on_webgpu_gives_the_steps_tokens(gpu_page, web_bundle):
    """The embedded SmolLM2 on WebGPU (its GGUF's blocks, exact, in MatMulNBits) answers as the WASM step and the
    native engine do, up to a near tie; the demo shows the device."""
    p = gpu_page(api=False)
    p.goto("/?device=webgpu")
    p.page.wait_for_function("window.ruvllm && (window.ruvllm.ready || window.ruvllm.error)", timeout=LOAD_TIMEOUT_MS)
    assert p.evaluate("window.ruvllm.error || null") is None, "\n".join(p.console)
    info = p.evaluate("window.ruvllm.engine.info")
    assert (info["device"], info["graph"], info["backend"]) == ("webgpu", "model_webgpu.onnx", "onnxruntime"), info
    assert p.page.inner_text("#i-device") == "WebGPU"
    # 4 tokens, all equal (a decode step of SmolLM2 takes SwiftShader ~10 s)
    reply = p.evaluate("(r) => window.ruvllm.engine.chat.completions.create(r)",
                       {"messages": SEA, "max_tokens": 4, "temperature": 0, "return_token_ids": True})
    steps = native_steps(web_bundle / "models" / "smollm2-135m", SEA, 4)
    assert_equal_up_to_a_near_tie(reply["choices"][0]["token_ids"], steps, 4)


def test_adapters_on_webgpu_give_the_native_tokens(gpu_page, tiny_package, peft_adapters, web_models):
    """PEFT adapters on WebGPU: the package's WebGPU LoRA graph (its blocks kept too), per request by `model`,
    batched beside the base model, as the native engine gives them on the same package."""
    package = tiny_package("llama", "int4", "wasm")
    gpu = onnx.load(package / "model_webgpu_lora.onnx", load_external_data=False).graph
    assert "DequantizeLinear" not in {n.op_type for n in gpu.node}
    url = publish(web_models, package, "tiny-llama-int4-wasm")
    adapter = peft_adapters("llama")["all16"]
    aurl = publish(web_models, adapter, "adapter-all16")
    p = gpu_page()
    assert p.evaluate(LOAD_ENGINE, [url, {"device": "webgpu", "speculativeTokens": 0}])["device"] == "webgpu"
    assert p.evaluate("async (url) => engine.loadAdapter('all16', url)", aurl)["rank"] == 16
    greedy = {"messages": SEA, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    replies = p.evaluate("""async ([req, names]) => Promise.all(names.map((model) =>
      engine.chat.completions.create(model ? { ...req, model } : req)))""", [greedy, ["all16", None]])
    tuned, base = (r["choices"][0]["token_ids"] for r in replies)
    assert_equal_up_to_a_near_tie(base, native_steps(package, SEA, 8), 4)
    assert_equal_up_to_a_near_tie(tuned, native_steps(package, SEA, 8, adapter), 4)
    assert tuned != base
