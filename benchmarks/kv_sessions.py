"""A saved KV session against a cold prefill: the time to the first token of a long prompt in a fresh engine,
with and without restoring the session an earlier engine saved for it, and whether the greedy tokens match.

    python benchmarks/kv_sessions.py [--model PKG_OR_ALIAS] [--tokens 2000] [--kv-dtype fp32] [--threads 2]

Prints JSON. The prompt is benchmarks/data/real_models_text.md, repeated to length. Each engine answers a short
unrelated request first, so neither time counts opening the graph.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.core.engine import Engine  # noqa: E402
from runtime.core.sampling import SamplingParams  # noqa: E402
from runtime.resolve import resolve_package  # noqa: E402

TEXT = Path(__file__).parent / "data" / "real_models_text.md"


def timed(engine: Engine, ids: list[int], n: int) -> tuple[float, list[int], int]:
    """(seconds to the first token, the greedy tokens, prompt tokens served from the cache)."""
    started, first, tokens, cached = time.perf_counter(), None, [], 0
    for out in engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)):
        first = first or time.perf_counter() - started
        tokens += out.token_ids
        cached = out.cached_tokens
    return first, tokens, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a package folder or alias (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--answer", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--kv-dtype", default="fp32", choices=["fp32", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    pkg = resolve_package(args.model, quiet=True)

    def engine() -> Engine:
        e = Engine.from_package(pkg, threads=args.threads, kv_dtype=args.kv_dtype)
        timed(e, e.encode_prompt("Hello there."), 2)
        return e

    live = engine()
    text = TEXT.read_text()
    ids = live.encode_prompt(text * (1 + 4 * args.tokens // max(1, len(text))))[:args.tokens]
    cold, tokens, _ = timed(live, ids, args.answer)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "session.bin"
        saved = live.save_session(path)
        del live
        fresh = engine()
        restored = fresh.restore_session(path)
        warm, again, cached = timed(fresh, ids, args.answer)
    print(json.dumps({
        "model": str(pkg), "kv_dtype": args.kv_dtype, "threads": args.threads, "prompt_tokens": len(ids),
        "ttft_cold_ms": round(1000 * cold, 1), "ttft_restored_ms": round(1000 * warm, 1),
        "ratio": round(warm / cold, 4), "cached_tokens": cached, "saved_tokens": saved["tokens"],
        "file_mb": round(saved["bytes"] / 2**20, 2), "save_ms": round(1000 * saved["seconds"], 1),
        "restore_ms": round(1000 * restored["seconds"], 1), "same_tokens": again == tokens,
        "tokens_compared": len(tokens)}, indent=1))


if __name__ == "__main__":
    main()
