"""Running streams while long prompts arrive, in the engine's own step loop (no HTTP): the streams' inter-token
gaps with and without the long prompts, and the long prompts' prefill rate.

    python benchmarks/mixed_load.py [--model PKG_OR_ALIAS] [--streams 16] [--long 8] [--long-tokens 1080]
                                    [--prefill-cap N ...] [--threads 2]

Each --prefill-cap runs the same load with EngineConfig.long_prefill_tokens = N (0: off, a prompt's chunk is
the step's whole budget). Streams: short chat prompts, greedy, ignore EOS, so they run through; the long prompts
arrive one every --every seconds once the streams decode, each generating --long-answer tokens. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from load import pct  # noqa: E402  (milliseconds, as load.py reports them)

from runtime.core.engine import Engine  # noqa: E402
from runtime.core.sampling import SamplingParams  # noqa: E402
from runtime.resolve import resolve_package  # noqa: E402

TEXT = Path(__file__).parent / "data" / "real_models_text.md"


def run(engine: Engine, streams: int, stream_tokens: int, long_prompts: list[list[int]], every: float,
        long_answer: int) -> dict:
    greedy = SamplingParams(temperature=0.0, max_tokens=stream_tokens, ignore_eos=True)
    last: dict[str, float] = {}
    gaps: list[float] = []
    short = {engine.add_request(messages=[{"role": "user", "content": f"Tell me about topic {i}."}], params=greedy)
             for i in range(streams)}
    pending, started_long, long_ids, first_token = list(long_prompts), None, {}, {}
    while engine.has_unfinished() or pending:
        now = time.perf_counter()
        decoding = len(last) == streams
        if pending and decoding and (started_long is None or now - started_long >= every * len(long_ids)):
            started_long = started_long or now
            rid = engine.add_request(pending.pop(0), SamplingParams(temperature=0.0, max_tokens=long_answer,
                                                                    ignore_eos=True))
            long_ids[rid] = now
        for out in engine.step():
            t = time.perf_counter()
            if out.request_id in short:
                if out.request_id in last and (not long_prompts or long_ids) and out.token_ids:
                    gaps.append(t - last[out.request_id])
                last[out.request_id] = t
            elif out.request_id in long_ids and out.request_id not in first_token:
                first_token[out.request_id] = t
        if long_prompts and not pending and len(first_token) == len(long_prompts):
            break  # every long prompt answered: the rest is the streams alone
    prompt_tokens = sum(len(p) for p in long_prompts[:len(first_token)])
    spent = max(first_token.values()) - min(long_ids.values()) if first_token else 0
    ttfts = [first_token[r] - long_ids[r] for r in first_token]
    for rid in list(engine.seqs):
        engine.abort(rid)
    return {"gap_p50_ms": pct(gaps, 0.5), "gap_p99_ms": pct(gaps, 0.99),
            "gap_max_ms": round(1000 * max(gaps, default=0), 1), "long_done": len(first_token),
            "long_ttft_p50_s": round(statistics.median(ttfts), 2) if ttfts else None,
            "prefill_tok_s": round(prompt_tokens / spent, 1) if spent else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=1000, help="enough to outlast the long prompts")
    ap.add_argument("--long", type=int, default=8, help="long prompts")
    ap.add_argument("--long-tokens", type=int, default=1080)
    ap.add_argument("--long-answer", type=int, default=4)
    ap.add_argument("--every", type=float, default=0.25, help="seconds between long prompts")
    ap.add_argument("--prefill-cap", type=int, nargs="+", default=[0, 256, 128, 64])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    pkg = resolve_package(args.model, quiet=True)
    text = TEXT.read_text()
    rows = []
    for cap in args.prefill_cap:
        engine = Engine.from_package(pkg, threads=args.threads, long_prefill_tokens=cap)
        ids = engine.encode_prompt(text * 4)
        longs = [ids[i * 37:i * 37 + args.long_tokens] for i in range(args.long)]  # distinct: no prefix hits
        base = run(engine, args.streams, 64, [], 0, 0)  # no long prompts: the streams alone
        engine.reset_prefix_cache()
        mixed = run(engine, args.streams, args.stream_tokens, longs, args.every, args.long_answer)
        rows.append({"long_prefill_tokens": cap, "alone": base, "mixed": mixed})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"model": str(pkg), "threads": args.threads, "streams": args.streams,
                      "long_prompts": args.long, "long_tokens": args.long_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
