"""`ruvllm bench`: TTFT, prefill and decode speed, throughput and latency under concurrency, prefix-cache effect.

Speed is measured here, never asserted in tests. Prints JSON.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time

from runtime.core.sampling import SamplingParams

LONG_PROMPT = 512  # tokens of the long-prefill measurement and of the prefix-cache one (480 of them shared)
SHORT_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
LONG_TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
             "books were made, how ideas spread and how people learned to read. ")


def _peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / (1024 * 1024)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_one(engine, params: SamplingParams, **kwargs) -> dict:
    """One request's time to first token and decode tok/s after it (exporter eval measures with it too)."""
    t0 = time.perf_counter()
    first = None
    n = prompt_tokens = cached = 0
    for out in engine.generate(params=params, **kwargs):
        if first is None:
            first = time.perf_counter()
        n, prompt_tokens, cached = out.completion_tokens, out.prompt_tokens, out.cached_tokens
    end = time.perf_counter()
    return {"ttft": first - t0, "decode_tps": (n - 1) / (end - first) if n > 1 else 0.0, "tokens": n,
            "prompt_tokens": prompt_tokens, "cached_tokens": cached}


def _text_tokens(engine, tokens: int, salt: str = "") -> list[int]:
    ids: list[int] = engine.tokenizer.encode(salt) if salt else []
    while len(ids) < tokens:
        ids.extend(engine.tokenizer.encode(LONG_TEXT))
    return ids[:tokens]


def concurrent(engine, streams: int, max_tokens: int, prefix: list[int] | None = None,
               adapters: list[str] | None = None, constraint=None, context: int = 0) -> dict:
    """`streams` requests at once; aggregate decode throughput, TTFT and inter-token latency percentiles.
    adapters: the streams run round-robin on these adapters' names (a mixed-adapter batch); constraint:
    each stream's structured output (runtime.core.constraints.Constraint); context: each stream's own
    prompt of that many tokens (nothing shared), to decode over long contexts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, constraint=constraint)
    starts, last, firsts = {}, {}, {}
    itl: list[float] = []
    t0 = time.perf_counter()
    for i in range(streams):
        question = engine.tokenizer.encode(f" Question {i}: tell me a story about the number {i}.")
        if context:
            question = _text_tokens(engine, context - len(question), salt=f"Stream {i}.") + question
        rid = engine.add_request((prefix or []) + question, SamplingParams(**vars(params)),
                                 adapter=adapters[i % len(adapters)] if adapters else None)
        starts[rid] = time.perf_counter()
    tokens = peak = 0
    while engine.has_unfinished():
        outs = engine.step()
        peak = max(peak, engine.scheduler.allocator.num_used)
        now = time.perf_counter()
        for out in outs:
            tokens += len(out.token_ids)
            if out.request_id in last:
                itl.append(now - last[out.request_id])
            else:
                firsts[out.request_id] = now
            last[out.request_id] = now
    wall = time.perf_counter() - t0
    ttfts = [firsts[r] - starts[r] for r in starts]
    decode_wall = max(last.values()) - min(firsts.values())
    return {
        "streams": streams, **({"adapters": len(adapters)} if adapters else {}),
        "aggregate_tps": round(tokens / wall, 1),
        "aggregate_decode_tps": round((tokens - streams) / decode_wall, 1) if decode_wall > 0 else None,
        "wall_s": round(wall, 2),
        "ttft_p50_ms": round(1000 * _pct(ttfts, 0.5), 1), "ttft_p99_ms": round(1000 * _pct(ttfts, 0.99), 1),
        "itl_p50_ms": round(1000 * _pct(itl, 0.5), 2), "itl_p99_ms": round(1000 * _pct(itl, 0.99), 2),
        "kv_blocks_peak": peak,
        "kv_mb_peak": round(peak * engine.block_size * engine.backend.kv_bytes_per_token(engine.pkg.config) / 2**20, 1),
    }


def adapter_levels(engine, args, levels: list[int], prefix: list[int] | None) -> dict:
    """The same concurrency levels with the streams spread over the adapters, beside the base model's, in
    alternating runs (base, mixed, base, mixed) so that a drift of the host's speed hits both alike."""
    names = []
    for i, folder in enumerate(a for a in args.adapters.split(",") if a.strip()):
        names.append(engine.adapters.add(f"bench-{i}", folder.strip()).name)
    out = {"names": names, "lora_kernel": engine.backend.info().lora_kernel or "the graph's own",
           "levels": []}
    for c in levels:
        runs = [(concurrent(engine, c, args.decode_tokens, prefix), concurrent(engine, c, args.decode_tokens, prefix,
                                                                              names)) for _ in range(2)]
        base = statistics.median(r[0]["aggregate_decode_tps"] or r[0]["aggregate_tps"] for r in runs)
        mixed = statistics.median(r[1]["aggregate_decode_tps"] or r[1]["aggregate_tps"] for r in runs)
        out["levels"].append({"streams": c, "base_decode_tps": round(base, 1), "mixed_decode_tps": round(mixed, 1),
                              "ratio": round(mixed / base, 3) if base else None, "mixed": runs[-1][1]})
    return out


# Structured output's bench schema: records that never close within a bench's tokens, so constrained
# streams decode as long as free ones
BENCH_SCHEMA = {"type": "array", "minItems": 10000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "name": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}


def structured_levels(engine, args, levels: list[int], prefix: list[int] | None) -> dict:
    """The concurrency levels constrained by a JSON schema beside free text, alternating (free,
    constrained, free, constrained), with the token mask's time per constrained step."""
    from runtime.core.constraints import Constraint

    constraint = getattr(args, "constraint", None) or Constraint("json_schema", BENCH_SCHEMA)
    backend = engine.backend
    out = {"schema": args.json_schema if getattr(args, "constraint", None) else "bench records", "levels": []}
    for c in levels:
        runs = []
        for _ in range(2):
            free = concurrent(engine, c, args.decode_tokens, prefix)
            before = backend.info()
            constrained = concurrent(engine, c, args.decode_tokens, prefix, constraint=constraint)
            after = backend.info()
            steps = after.mask_steps - before.mask_steps
            constrained["mask_ms_per_step"] = (round(1000 * (after.mask_seconds - before.mask_seconds) / steps, 3)
                                               if steps else None)
            runs.append((free, constrained))
        base = statistics.median(r[0]["aggregate_decode_tps"] or r[0]["aggregate_tps"] for r in runs)
        con = statistics.median(r[1]["aggregate_decode_tps"] or r[1]["aggregate_tps"] for r in runs)
        out["levels"].append({"streams": c, "free_decode_tps": round(base, 1), "constrained_decode_tps": round(con, 1),
                              "ratio": round(con / base, 3) if base else None,
                              "mask_ms_per_step": runs[-1][1]["mask_ms_per_step"], "constrained": runs[-1][1]})
    return out


def prefix_effect(engine, total: int, shared: int) -> dict:
    """TTFT of a `total`-token prompt whose first `shared` tokens are cached, against the uncached TTFT."""
    base = _text_tokens(engine, shared, salt="Shared context for the benchmark.")
    one = SamplingParams(temperature=0.0, max_tokens=1)
    uncached, cached = [], []
    for i in range(3):
        tail = _text_tokens(engine, total - shared, salt=f"Variant {i} asks something else entirely.")
        fresh = _text_tokens(engine, total, salt=f"An unrelated document number {i}.")
        uncached.append(run_one(engine, SamplingParams(**vars(one)), prompt=fresh)["ttft"])
        run_one(engine, SamplingParams(**vars(one)), prompt=base + tail)  # warms the shared prefix
        tail2 = _text_tokens(engine, total - shared, salt=f"Variant {i} then asks a second question.")
        r = run_one(engine, SamplingParams(**vars(one)), prompt=base + tail2)
        cached.append(r["ttft"])
    u, c = statistics.median(uncached), statistics.median(cached)
    return {"prompt_tokens": total, "shared_tokens": shared, "ttft_uncached_ms": round(1000 * u, 1),
            "ttft_cached_ms": round(1000 * c, 1), "ratio": round(c / u, 3), "cached_tokens_last": r["cached_tokens"]}


def run_bench(engine, args) -> dict:
    greedy = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    # a base model (no chat template: Gemma 3 270M's GGUF) is asked the same question as text
    ask = {"messages": SHORT_PROMPT} if engine.chat_template else {"prompt": SHORT_PROMPT[0]["content"]}
    run_one(engine, SamplingParams(temperature=0.0, max_tokens=4), **ask)  # warm up
    short = [run_one(engine, SamplingParams(**vars(greedy)), **ask) for _ in range(args.repeats)]
    long = min(LONG_PROMPT, engine.pkg.config["max_positions"] - 1)  # a short-context model: its longest prompt
    long_runs = [run_one(engine, SamplingParams(temperature=0.0, max_tokens=1),
                          prompt=_text_tokens(engine, long, salt=f"Document {i}."))
                 for i in range(args.repeats)]
    med = statistics.median
    info = engine.backend.info()
    result = {
        "model": engine.pkg.name, "quantization": engine.pkg.manifest["quantization"]["weights"],
        "backend": info.name, "device": info.device, "matmul_kernel": info.matmul_kernel,
        "attention_kernel": info.attention_kernel, "batch_invariant": info.batch_invariant,
        "kv_blocks": engine.scheduler.allocator.num_blocks, "kv_block_size": engine.block_size,
        "speculative_tokens": engine.config.speculative_tokens, "speculative_max_batch": engine.config.speculative_max_batch,
        "ttft_ms": round(1000 * med(r["ttft"] for r in short), 1),
        "prefill_tps_short": round(med(r["prompt_tokens"] / r["ttft"] for r in short), 1),
        f"prefill_tps_{long}": round(med(r["prompt_tokens"] / r["ttft"] for r in long_runs), 1),
        f"ttft_{long}_ms": round(1000 * med(r["ttft"] for r in long_runs), 1),
        "decode_tps": round(med(r["decode_tps"] for r in short), 1),
        "decode_tokens": args.decode_tokens,
    }
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    prefix = _text_tokens(engine, args.shared_prefix, salt="System: you are a storyteller.") \
        if args.shared_prefix else None
    if levels != [1]:
        result["kv_budget_mb"] = round(engine.scheduler.allocator.num_blocks * engine.block_size
                                       * engine.backend.kv_bytes_per_token(engine.pkg.config) / 2**20, 1)
        result["concurrency"] = [concurrent(engine, c, args.decode_tokens, prefix, context=args.context)
                                 for c in levels]
    if getattr(args, "adapters", None):
        result["adapters"] = adapter_levels(engine, args, levels, prefix)
    if getattr(args, "structured", False) or getattr(args, "json_schema", None):
        result["structured"] = structured_levels(engine, args, levels, prefix)
    if args.shared_prefix:
        result["prefix_cache"] = prefix_effect(engine, long, min(args.shared_prefix, long - 32))
    result["engine_stats"] = engine.stats_snapshot()
    info = engine.backend.info()
    result["kv"] = {"dtype": info.kv_dtype,
                    "bytes_per_token": engine.backend.kv_bytes_per_token(engine.pkg.config),
                    "blocks": engine.scheduler.allocator.num_blocks, "block_size": engine.block_size,
                    # the pool's memory is committed as blocks are used (the native CPU pool)
                    "committed_mb": round(info.kv_committed_bytes / 2**20, 1) if info.kv_committed_bytes is not None else None}
    result["peak_rss_mb"] = round(_peak_rss_mb(), 1)
    if getattr(args, "plot", None) and "concurrency" in result:
        plot(result, args.plot)
        result["plot"] = args.plot
    return result


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        from runtime.errors import RuvLLMError

        raise RuvLLMError("--plot needs matplotlib: pip install matplotlib") from err
    levels = result["concurrency"]
    xs = [lv["streams"] for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [lv["aggregate_tps"] for lv in levels], "o-")
    a.set(xscale="log", xlabel="concurrent streams", ylabel="aggregate tok/s", title="Throughput")
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
                       ("itl_p50_ms", "ITL p50"), ("itl_p99_ms", "ITL p99")):
        b.plot(xs, [lv[key] for lv in levels], "o-", label=label)
    b.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title="Latency")
    b.legend()
    fig.suptitle(f"{result['model']} ({result['quantization']}), {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
