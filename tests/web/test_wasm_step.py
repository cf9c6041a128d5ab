"""The page's WASM decode step (wasm/step/step.c), built with zig and run in wasmtime: the same GGUF blocks
as the native engine's default package give its logits, and the engine's own scheduler (continuous
batching, chunked prefill, paged KV, prefix hits) drives it as it will in the page (issue 33)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.core.step_batch import Chunk, StepResult, build_step

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type with an oil-based ink and a screw press.")


@pytest.fixture(scope="session")
def step_files(workdir, smol_gguf):
    """step.wasm, and SmolLM2's step weights (its GGUF's own blocks, repacked) beside it."""
    from exporter.step_weights import write_step_weights
    from wasm.step_module import build

    out = workdir / "wasm-step"
    out.mkdir(exist_ok=True)
    build(out / "step.wasm")
    write_step_weights(smol_gguf, out, max_pos=1024)
    return out


class WasmtimeBackend:
    """A backend running every step on step.wasm in wasmtime; candidates are the logits' log-softmax top-k
    (greedy requests only: no penalties or temperature)."""

    name = "wasm-step (wasmtime)"
    kv_exact_blocks = 1

    def __init__(self, files) -> None:
        self.files = files
        self.step = None

    def kv_bytes_per_token(self, cfg: dict) -> int:
        from runtime.core.kv_blocks import kv_bytes_per_token

        return kv_bytes_per_token(cfg)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        from wasm.step_module import WasmStep

        self.step = WasmStep(self.files / "step.wasm", self.files, num_blocks, block_size, max_tokens=128)

    def run(self, batch) -> StepResult:
        logits = self.step.run(batch).astype(np.float64)
        logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        top = np.argsort(-logprobs, axis=1, kind="stable")[:, :batch.top_k]
        return StepResult(top.tolist(), np.take_along_axis(logprobs, top, 1).tolist(),
                          logits.astype(np.float32) if batch.want_full_logits else None)


def log_softmax(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    return a - np.logaddexp.reduce(a, axis=1, keepdims=True)


@pytest.mark.slow
def test_the_wasm_step_computes_the_native_engines_logits(step_files, smol_int4):
    """A prompt prefilled in one step, teacher-forced: position 0 equal to the native engine's on the
    default package (the same Q4_1 / Q8_0 blocks, activations rounded per block of 32 on both sides);
    later positions within the int8-activation floor (attention's summation order differs, and the next
    layer's rounding amplifies it: mean KL ~0.003 measured)."""
    from runtime.core.engine import Engine
    from wasm.step_module import WasmStep

    engine = Engine.from_package(smol_int4, verify=False)
    ids = engine.encode_prompt(PROMPT)
    bs, table = 16, list(range(8))
    slots = [table[p // bs] * bs + p % bs for p in range(len(ids))]
    batch = build_step([Chunk(ids, 0, table, slots, True, logits_rows=len(ids), top_k=5)], bs, want_full_logits=True)
    want = log_softmax(np.asarray(engine.backend.run(batch).logits))
    got = log_softmax(WasmStep(step_files / "step.wasm", step_files, 16, bs).run(batch))
    kl = (np.exp(want) * (want - got)).sum(axis=1)
    assert kl[0] < 1e-6, kl[0]
    assert kl.mean() < 0.01 and kl.max() < 0.05, (kl.mean(), kl.max())
    assert (want.argmax(1) == got.argmax(1)).mean() >= 0.85


@pytest.mark.slow
def test_the_engine_drives_the_wasm_step_as_it_drives_onnxruntime(step_files, smol_int4):
    """The engine's scheduler over WasmtimeBackend: six prompts sharing a prefix, admitted together with
    chunked prefill (16 tokens a step), prefix-cache hits and blocks of 16 in a table of its own order;
    each one's greedy tokens equal its run alone (a token's numbers do not depend on its batch), and the
    printing-press prompt's 24 tokens equal the native engine's."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams
    from runtime.package import load_package

    pkg = load_package(smol_int4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    shared = ("You are a careful assistant. You answer every question in one short sentence, in plain words, "
              "without lists, and you never repeat the question back. Question: ")  # three blocks and more
    prompts = [shared + q for q in ("Why is the sky blue?", "What is a prime number?", "Name a red fruit.",
                                    "How do birds fly?", "What is rain?", "Who wrote Hamlet?")]
    engine = Engine(pkg, WasmtimeBackend(step_files), num_blocks=64, max_batch_tokens=16, speculative_tokens=0)
    rids = [engine.add_request(p, params) for p in prompts]
    got = {r: [] for r in rids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert engine.stats_snapshot()["prefix_cache_hits"] > 0
    alone = Engine(pkg, WasmtimeBackend(step_files), num_blocks=64, enable_prefix_cache=False, speculative_tokens=0)
    for rid, prompt in zip(rids, prompts):
        assert got[rid] == [t for o in alone.generate(prompt, params) for t in o.token_ids], prompt

    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    native = Engine.from_package(smol_int4, verify=False, speculative_tokens=0)
    want = [t for o in native.generate(PROMPT, long) for t in o.token_ids]
    assert [t for o in alone.generate(PROMPT, long) for t in o.token_ids] == want
