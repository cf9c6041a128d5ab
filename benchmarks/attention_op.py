"""ruvllm.PagedAttention alone, on the step shapes that decide its cost (issue 50's gate: the batch-invariant
arithmetic must not make these slower). SmolLM2's heads (9 query / 3 kv, head_dim 64) unless told; fp32 pool.

    python benchmarks/attention_op.py [--threads 2] [--rounds 15] [--heads 9,3,64]

Prints JSON: per case, the median ms of one call times the layer count (30), over `rounds` rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = 16


def graph(Hq: int, Hkv: int, D: int) -> bytes:
    from onnx import TensorProto, helper

    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    names = [("qk", f), ("v", f), ("pool_k", f), ("pool_v", f), ("tables", i64), ("qidx", i64), ("pos", i64)]
    node = helper.make_node("PagedAttention", [n for n, _ in names], ["out"], domain="ruvllm", num_heads=Hq,
                            num_kv_heads=Hkv, sliding_window=0, scale=float(1 / np.sqrt(D)), softcap=0.0)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in names],
                          [helper.make_tensor_value_info("out", f, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21),
                                               helper.make_opsetid("ruvllm", 1)]).SerializeToString()


def step(rows: list[tuple[int, int, int]], Hq: int, Hkv: int, D: int, pool_blocks: int, rng) -> dict:
    """rows: (cached positions, new tokens, shared prefix positions); rows with a shared prefix read the same
    first blocks."""
    tables, free = [], iter(range(64, pool_blocks))
    for cached, new, shared in rows:
        n = -(-(cached + new) // BLOCK)
        own = [next(free) for _ in range(n - shared // BLOCK)]
        tables.append(list(range(shared // BLOCK)) + own)
    width = max(len(t) for t in tables)
    S = max(new for _, new, _ in rows)
    qidx, pos, at = np.zeros((len(rows), S), np.int64), [], 0
    for b, (cached, new, _) in enumerate(rows):
        qidx[b] = [at + min(i, new - 1) for i in range(S)]
        pos += range(cached, cached + new)
        at += new
    return {"qk": rng.standard_normal((at * (Hq + Hkv), D), dtype=np.float32),
            "v": rng.standard_normal((at * Hkv, D), dtype=np.float32),
            "tables": np.array([t + [0] * (width - len(t)) for t in tables], np.int64), "qidx": qidx,
            "pos": np.array(pos, np.int64)}


CASES = {
    "prefill_512": [(0, 512, 0)],
    "cached_480_then_32": [(480, 32, 480)],
    "decode_1x2048": [(2048, 1, 0)],
    "decode_16_shared_480": [(480 + 8 + i, 1, 480) for i in range(16)],
    "decode_64_shared_480": [(480 + 8 + i, 1, 480) for i in range(64)],
    "decode_16_distinct_520": [(520, 1, 0) for _ in range(16)],
}


def main() -> None:
    import onnxruntime as ort

    from runtime.backends.kernel_library import library

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head_dim")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--cases", default=",".join(CASES), help="which of " + ", ".join(CASES))
    ap.add_argument("--lib", nargs="*", default=None, help="kernel libraries to compare (default: this build's)")
    args = ap.parse_args()
    Hq, Hkv, D = (int(x) for x in args.heads.split(","))
    libs = args.lib
    if not libs:
        lib, why = library()
        if lib is None:
            sys.exit(f"no kernel library: {why}")
        libs = [str(lib)]
    sessions = {}
    for lib in libs:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        opts.register_custom_ops_library(lib)
        sessions[lib] = ort.InferenceSession(graph(Hq, Hkv, D), opts)
    rng = np.random.default_rng(0)
    cases = {name: CASES[name] for name in args.cases.split(",")}
    blocks = 64 + max(sum(-(-(c + n) // BLOCK) for c, n, _ in rows) for rows in cases.values())
    pool = {k: rng.standard_normal((Hkv, blocks, BLOCK, D), dtype=np.float32) for k in ("pool_k", "pool_v")}
    feeds = {name: {**step(rows, Hq, Hkv, D, blocks, rng), **pool} for name, rows in cases.items()}
    times: dict[str, dict[str, list[float]]] = {lib: {name: [] for name in cases} for lib in sessions}
    for _ in range(args.rounds):  # cases and libraries interleaved, so a drifting host moves them alike
        for name, f in feeds.items():
            for lib, sess in sessions.items():
                t = time.perf_counter()
                for _ in range(args.layers):
                    sess.run(None, f)
                times[lib][name].append((time.perf_counter() - t) * 1e3)
    print(json.dumps({"heads": [Hq, Hkv, D], "threads": args.threads, "layers": args.layers,
                      "ms": {lib: {k: round(statistics.median(v), 2) for k, v in t.items()} for lib, t in times.items()},
                      "min_ms": {lib: {k: round(min(v), 2) for k, v in t.items()} for lib, t in times.items()}},
                     indent=1))


if __name__ == "__main__":
    main()
