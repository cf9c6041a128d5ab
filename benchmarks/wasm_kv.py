"""The WASM step's KV pools (fp32, int8, int4) in wasmtime: decode and prefill speed at a long context, and how
close each pool's numbers are to the native engine's on the same kind of pool. Not a test: prints JSON.

    python benchmarks/wasm_kv.py speed [--context 1500] [--decode 24] [--pools fp32,int8,int4]
    python benchmarks/wasm_kv.py agreement [--tokens 512] [--prompts 20] [--pools fp32,int8,int4]

Builds step.wasm and SmolLM2's step weights into a scratch folder; `agreement` also needs the default package
(the demo makes it). The page's own figures come from benchmarks/browser.py --kv fp32,int8,int4.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.core.kv_tails import TailSlots  # noqa: E402
from runtime.core.step_batch import Chunk, build_step  # noqa: E402

BS = 16


def step_folder(max_pos: int) -> Path:
    from exporter.step_weights import write_step_weights
    from runtime.aliases import embedded_gguf_path
    from wasm.step_module import build

    out = Path(tempfile.mkdtemp(prefix="wasm-kv-"))
    build(out / "step.wasm")
    write_step_weights(embedded_gguf_path(), out, max_pos=max_pos)
    return out


def speed(args) -> dict:
    from wasm.step_module import WasmStep

    folder = step_folder(args.context + args.decode + 64)
    ids = np.random.default_rng(0).integers(100, 20000, args.context).tolist()
    blocks = -(-(args.context + args.decode) // BS) + 1
    table, rows = list(range(blocks)), {}
    for pool in args.pools.split(","):
        step = WasmStep(folder / "step.wasm", folder, blocks, BS, max_tokens=128, kv_dtype=pool)
        tails = TailSlots(BS) if pool != "fp32" else None

        def run(tokens, start, logits, step=step, tails=tails):
            slots = [table[p // BS] * BS + p % BS for p in range(start, start + len(tokens))]
            batch = build_step([Chunk(tokens, start, table[:(start + len(tokens) - 1) // BS + 1], slots, logits)], BS)
            step.run(batch, *(tails.step_slots(batch) if tails else ()))

        t0 = time.perf_counter()
        for s in range(0, len(ids), 128):
            run(ids[s:s + 128], s, s + 128 >= len(ids))
        t1 = time.perf_counter()
        for p in range(len(ids), len(ids) + args.decode):
            run([5], p, True)
        t2 = time.perf_counter()
        rows[pool] = {"prefill_s": round(t1 - t0, 2), "decode_tok_s": round(args.decode / (t2 - t1), 2)}
    return {"context": args.context, "threads": 1, "pools": rows}


def agreement(args) -> dict:
    """Teacher-forced KL of the step against the native engine on each pool, and greedy chat texts equal."""
    from runtime.aliases import cached_package_dir
    from runtime.backends.native import NativeBackend
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams
    from runtime.package import load_package
    from tests.runtime.test_kv_int8 import CHAT_PROMPTS
    from tests.web.test_wasm_kv import teacher_forced
    from tests.web.test_wasm_step import WasmtimeBackend

    folder = step_folder(2048)
    package = cached_package_dir("smollm2-135m", "int4")  # the default package (the demo's)
    if not (package / "manifest.json").exists():
        raise SystemExit(f"no default package at {package}: run the demo (README) once")
    pkg = load_package(package)
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    ids = Engine.from_package(package, verify=False).encode_prompt(text)[:args.tokens]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=5)

    def greedy(engine):
        rids = [engine.add_request(messages=[{"role": "user", "content": p}], params=params)
                for p in CHAT_PROMPTS[:args.prompts]]
        out = {r: [] for r in rids}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.logprobs
        return [out[r] for r in rids]

    def kl(a, b):
        return float((np.exp(a) * (a - b)).sum(axis=1).mean())

    forced, rows = {}, {}
    for pool in args.pools.split(","):
        forced["native", pool] = teacher_forced(NativeBackend(pkg, kv_dtype=pool), ids, 16, blocks=-(-len(ids) // BS) + 1)
        forced["step", pool] = teacher_forced(WasmtimeBackend(folder, kv_dtype=pool), ids, 16, blocks=-(-len(ids) // BS) + 1)
        native = greedy(Engine.from_package(package, verify=False, speculative_tokens=0, kv_dtype=pool))
        stepped = greedy(Engine(pkg, WasmtimeBackend(folder, kv_dtype=pool), num_blocks=256, max_batch_tokens=128,
                                speculative_tokens=0))
        margins = []  # where a text parts: the native engine's margin between its token and the step's
        for a, b in zip(native, stepped):
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x.token_id != y.token_id), None)
            if at is not None:
                top = dict(a[at].top)
                margins.append(round(top[a[at].token_id] - top.get(b[at].token_id, float("-inf")), 3))
        a, b = forced["native", pool], forced["step", pool]
        rows[pool] = {"kl_native_step": round(kl(a, b), 4), "top1_native_step": round(float((a.argmax(1) == b.argmax(1)).mean()), 3),
                      "greedy_equal": len(native) - len(margins), "greedy_of": len(native), "parted_margins": margins}
        if pool != "fp32" and ("native", "fp32") in forced:
            rows[pool]["kl_native_vs_fp32"] = round(kl(forced["native", "fp32"], a), 4)
            rows[pool]["kl_step_vs_fp32"] = round(kl(forced["step", "fp32"], b), 4)
    return {"tokens": len(ids), "pools": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("speed", "agreement"))
    ap.add_argument("--pools", default="fp32,int8,int4")
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=20)
    args = ap.parse_args()
    print(json.dumps(speed(args) if args.what == "speed" else agreement(args), indent=1))


if __name__ == "__main__":
    main()
