"""`ruvllm bench`: TTFT, prefill and decode speed, aggregate throughput under concurrency, peak RSS."""

from __future__ import annotations

import resource
import statistics
import sys
import time

from runtime.sampling import SamplingParams

SHORT_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
LONG_TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
             "books were made, how ideas spread and how people learned to read. ")


def _peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / (1024 * 1024)


def _run_one(engine, params: SamplingParams, **kwargs) -> dict:
    t0 = time.perf_counter()
    first = None
    n = 0
    prompt_tokens = 0
    for out in engine.generate(params=params, **kwargs):
        if first is None:
            first = time.perf_counter()
        n = out.completion_tokens
        prompt_tokens = out.prompt_tokens
    end = time.perf_counter()
    return {"ttft": first - t0, "decode_tps": (n - 1) / (end - first) if n > 1 else 0.0, "tokens": n,
            "prompt_tokens": prompt_tokens}


def _long_prompt(engine, tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < tokens:
        ids.extend(engine.tokenizer.encode(LONG_TEXT))
    return ids[:tokens]


def _concurrent(engine, streams: int, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    starts, firsts, done = {}, {}, {}
    for i in range(streams):
        rid = engine.add_request(params=SamplingParams(**vars(params)),
                                 messages=[{"role": "user", "content": f"Tell me a story about the number {i}."}])
        starts[rid] = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
            firsts.setdefault(out.request_id, time.perf_counter())
            if out.finished:
                done[out.request_id] = time.perf_counter()
    wall = time.perf_counter() - t0
    ttfts = sorted(firsts[r] - starts[r] for r in starts)
    return {"streams": streams, "aggregate_tps": round(tokens / wall, 1), "wall_s": round(wall, 2),
            "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1),
            "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1)}


def run_bench(engine, args) -> dict:
    greedy = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    _run_one(engine, SamplingParams(temperature=0.0, max_tokens=4), messages=SHORT_PROMPT)  # warm up
    short = [_run_one(engine, SamplingParams(**vars(greedy)), messages=SHORT_PROMPT) for _ in range(args.repeats)]
    long_ids = _long_prompt(engine, 512)
    long = [_run_one(engine, SamplingParams(temperature=0.0, max_tokens=1), prompt=long_ids)
            for _ in range(args.repeats)]
    med = statistics.median
    result = {
        "model": engine.pkg.name, "quantization": engine.pkg.manifest["quantization"]["weights"],
        "backend": engine.backend.name, "device": ",".join(getattr(engine.backend, "providers", [])),
        "ttft_ms": round(1000 * med(r["ttft"] for r in short), 1),
        "prefill_tps_short": round(med(r["prompt_tokens"] / r["ttft"] for r in short), 1),
        "prefill_tps_512": round(med(r["prompt_tokens"] / r["ttft"] for r in long), 1),
        "ttft_512_ms": round(1000 * med(r["ttft"] for r in long), 1),
        "decode_tps": round(med(r["decode_tps"] for r in short), 1),
        "decode_tokens": args.decode_tokens,
    }
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if levels != [1]:
        result["concurrency"] = [_concurrent(engine, c, args.decode_tokens) for c in levels]
    result["peak_rss_mb"] = round(_peak_rss_mb(), 1)
    return result
