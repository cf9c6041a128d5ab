"""Peak RSS of one short chat (issue 47's memory gate): load, then one chat answer of 64 greedy tokens, each
engine in its own process on the same GGUF (RuvLLM on its int4 export of the file). Prints JSON.

    python benchmarks/chat_rss.py FILE.gguf [--package DIR] [--n-ctx 4096]

--package: RuvLLM's package of the file (default: exported once into the cache, as `ruvllm generate FILE`
does). --n-ctx: llama.cpp's context (its KV cache is allocated for all of it at load; llama-cli's default is
4096); RuvLLM's KV pool grows with the blocks in use.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from sizes import peak_rss_mb  # benchmarks/, this script's folder, is on sys.path

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


def one(engine: str, gguf: str, package: str, n_ctx: int) -> dict:
    """In this process: load, one chat answer, the peak RSS."""
    started = time.perf_counter()
    if engine == "llama.cpp":
        from llama_cpp import Llama

        model = Llama(model_path=gguf, n_threads=2, n_threads_batch=2, n_ctx=n_ctx, verbose=False)
        loaded = time.perf_counter()
        chunks = list(model.create_chat_completion(messages=MESSAGES, max_tokens=64, temperature=0, stream=True))
        tokens = len(chunks)
    else:
        sys.path.insert(0, str(ROOT))
        from runtime.core.engine import Engine

        model = Engine.from_package(package, threads=2, speculative_tokens=0)
        loaded = time.perf_counter()
        tokens = sum(len(o.token_ids) for o in model.generate(
            messages=MESSAGES, params=model.sampling_params(temperature=0, max_tokens=64)))
    return {"engine": engine, "peak_rss_mb": peak_rss_mb(), "load_s": round(loaded - started, 2), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--package", default=None)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # the child process's one engine
    args = ap.parse_args()
    if args.engine:
        print(json.dumps(one(args.engine, str(args.gguf), args.package, args.n_ctx)))
        return
    package = args.package
    if package is None:
        sys.path.insert(0, str(ROOT))
        from runtime.resolve import resolve_package

        package = str(resolve_package(str(args.gguf)))
    rows = []
    for engine in ("llama.cpp", "ruvllm"):
        proc = subprocess.run([sys.executable, __file__, str(args.gguf), "--package", package, "--n-ctx",
                               str(args.n_ctx), "--engine", engine], capture_output=True, text=True, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    ratio = round(rows[1]["peak_rss_mb"] / rows[0]["peak_rss_mb"], 3)
    print(json.dumps({"gguf": str(args.gguf), "package": package, "n_ctx": args.n_ctx, "rows": rows,
                      "ruvllm_over_llamacpp": ratio}))


if __name__ == "__main__":
    main()
