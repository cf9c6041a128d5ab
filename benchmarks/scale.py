"""The seed's scale on this machine: a Mistral-7B-shape Q4_K_M exported within the memory gate and served
to 50 concurrent streams with 1,024-token contexts on an int8 KV cache, beside llama.cpp serving the same
prompts as 50 parallel sequences (not a test).

    python benchmarks/scale.py [--shape mistral7b] [--type Q4_K_M] [--streams 50] [--prompt 896] [--tokens 128]

The file is benchmarks/sizes.py's (a random-weight model of the shape with SmolLM2's vocabulary, converted
and quantized by llama.cpp's own tools); RuvLLM exports it (`python -m exporter convert`: wall time, peak
RSS against the gate 1.5 GB + 0.25 x the package). Each engine then runs in a process of its own on
--threads threads: every stream gets its own prompt of --prompt random tokens (nothing shared, no prefix
cache), all submitted at once, and decodes --tokens greedy tokens, so every context reaches prompt + tokens.
Reported per engine: streams finished and refused, the wall time until every stream had its first token,
aggregate decode tok/s after that, total tokens / wall, peak RSS (VmHWM) and the KV cache's size.

RuvLLM: `Engine` with max_num_seqs = streams, `kv_dtype="int8"`, a KV budget of --kv-memory (its pool
grows with the blocks in use). llama.cpp (llama-cpp-python, not a project dependency): one context with
n_seq_max = streams and a KV cache of prompt + tokens cells a sequence in q8_0 (flash attention,
which llama.cpp needs for a quantized V), prompts fed in batches of 512 tokens as its server does, then one
llama_decode a step with a token of every sequence. Prints JSON; keeps the files in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sizes  # noqa: E402  (benchmarks/sizes.py: the files, the export, peak RSS)
from peers import batch_decoder  # noqa: E402


def prompts(streams: int, length: int) -> list[list[int]]:
    import random

    return [[random.Random(1000 + s).randrange(100, 40000) for _ in range(length)] for s in range(streams)]


def run_ruvllm(pkg: str, args) -> dict:
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams

    t_load = time.perf_counter()
    engine = Engine.from_package(pkg, threads=args.threads, max_num_seqs=args.streams, enable_prefix_cache=False,
                                 speculative_tokens=0, kv_dtype="int8", kv_memory=int(args.kv_memory * 2**30))
    load_s = time.perf_counter() - t_load
    refused, ids = 0, []
    t0 = time.perf_counter()
    for p in prompts(args.streams, args.prompt):
        try:
            ids.append(engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)))
        except Exception as e:  # noqa: BLE001  (a refusal is the result, not a crash)
            refused += 1
            print(f"refused: {e}", file=sys.stderr)
    first: dict = {}
    tokens = after = 0
    all_first = None
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            tokens += len(o.token_ids)
            if o.request_id not in first:
                first[o.request_id] = now
            elif all_first is not None:
                after += len(o.token_ids)
        if all_first is None and len(first) == len(ids):
            all_first = now
    end = time.perf_counter()
    finished = sum(1 for r in ids if r in first)
    per_token = engine.backend.kv_bytes_per_token(engine.pkg.config)
    return {"load_s": round(load_s, 1), "streams_finished": finished, "refused": refused,
            "prefill_wall_s": round(all_first - t0, 1), "aggregate_decode_tok_s": round(after / (end - all_first), 1),
            "aggregate_tok_s": round(tokens / (end - t0), 1), "wall_s": round(end - t0, 1),
            "kv_mb": round(args.streams * (args.prompt + args.tokens) * per_token / 2**20),
            "peak_rss_mb": sizes.peak_rss_mb()}


def run_llamacpp(gguf: str, args) -> dict:
    import ctypes

    import llama_cpp as L
    import numpy as np

    t_load = time.perf_counter()
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(gguf.encode(), mparams)
    params = L.llama_context_default_params()
    params.n_ctx = args.streams * (args.prompt + args.tokens)
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = args.streams
    params.kv_unified = False  # a KV stream per sequence: each attends over its own cells (unified, over all of them)
    params.n_threads = params.n_threads_batch = args.threads
    params.type_k = params.type_v = L.GGML_TYPE_Q8_0
    params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit("llama.cpp could not make the context")
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(512, 0, 1)
    load_s = time.perf_counter() - t_load
    decode = batch_decoder(ctx, batch)

    def argmax(row: int) -> int:
        ptr = L.llama_get_logits_ith(ctx, row)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (vocab,)).argmax())

    t0 = time.perf_counter()
    entries = [(tok, pos, s, pos == args.prompt - 1) for s, p in enumerate(prompts(args.streams, args.prompt))
               for pos, tok in enumerate(p)]
    toks = [0] * args.streams
    for at in range(0, len(entries), 512):  # the prompts in batches of 512 tokens, a sequence's last gives logits
        chunk = entries[at:at + 512]
        decode(chunk)
        for row, (_, _, s, want) in enumerate(chunk):
            if want:
                toks[s] = argmax(row)
    all_first = time.perf_counter()
    for step in range(1, args.tokens):
        decode([(toks[s], args.prompt + step - 1, s, True) for s in range(args.streams)])
        toks = [argmax(s) for s in range(args.streams)]
    end = time.perf_counter()
    L.llama_batch_free(batch)
    kv = L.llama_state_get_size(ctx)
    L.llama_free(ctx)
    return {"load_s": round(load_s, 1), "streams_finished": args.streams, "refused": 0,
            "prefill_wall_s": round(all_first - t0, 1),
            "aggregate_decode_tok_s": round(args.streams * (args.tokens - 1) / (end - all_first), 1),
            "aggregate_tok_s": round(args.streams * args.tokens / (end - t0), 1), "wall_s": round(end - t0, 1),
            "kv_mb": round(kv / 2**20), "peak_rss_mb": sizes.peak_rss_mb()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="mistral7b", help=f"of {', '.join(sizes.SHAPES)}")
    ap.add_argument("--type", default="Q4_K_M", help=f"of {', '.join(sizes.FTYPES)}")
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--prompt", type=int, default=896)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-memory", type=float, default=4.0, help="RuvLLM's KV budget in GiB")
    ap.add_argument("--engines", default="ruvllm,llama.cpp")
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "ruvllm" / "bench" / "sizes"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps((run_llamacpp if args.worker == "llama.cpp" else run_ruvllm)(args.path, args)))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    gguf = sizes.gguf_file(work, args.shape, args.type)
    row = {"shape": args.shape, "type": args.type, "streams": args.streams, "prompt": args.prompt,
           "tokens": args.tokens, "threads": args.threads}
    if "ruvllm" in args.engines.split(","):
        row.update(sizes.export(work, gguf))
        row["export_rss_gate_mb"] = round(1536 + 0.25 * row["package_mb"])
    print(json.dumps(row), file=sys.stderr, flush=True)
    for engine in args.engines.split(","):
        path = str(gguf) if engine == "llama.cpp" else row["package"]
        cmd = [sys.executable, __file__, "--worker", engine, "--path", path] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k in ("streams", "prompt", "tokens", "threads", "kv_memory")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode:
            row[engine] = {"error": (proc.stderr.strip().splitlines() or [str(proc.returncode)])[-1][:300]}
        else:
            row[engine] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps({engine: row[engine]}), file=sys.stderr, flush=True)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), **row}, indent=1))


if __name__ == "__main__":
    main()
