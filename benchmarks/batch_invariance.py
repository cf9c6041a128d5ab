"""Whether a request's tokens depend on what runs beside it (issue 50): each request alone, then all at once.

4 system prompts of ~200 tokens x 4 questions, greedy, on the native engine: the requests that share a system
prompt share its KV blocks (prefix cache, cascade attention in ruvllm.PagedAttention). Prints JSON: how many
requests' tokens (and logprobs, bit for bit) differ from their solo run. Set RUVLLM_PAGED_ATTENTION=0 to run the
graph's own attention instead.

    python benchmarks/batch_invariance.py [--package DIR] [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPICS = ["bees and how they make honey", "the history of the bicycle", "volcanoes and how they erupt",
          "the rules of chess"]
QUESTIONS = ["Give me one fact.", "What is the most surprising thing about it?", "Explain it to a child.",
             "Summarize it in one sentence."]


def system_prompt(topic: str) -> str:
    """~200 tokens of instructions about one topic."""
    rules = " ".join(f"Rule {i}: answer briefly, stay on {topic}, and be accurate and friendly." for i in range(12))
    return f"You are an expert on {topic}. {rules}"


def requests(shared: bool = True) -> list[list[dict]]:
    """shared: the 4 questions of a topic share its system prompt; else each system prompt is its own."""
    return [[{"role": "system", "content": ("" if shared else f"Case {i}. ") + system_prompt(t)},
             {"role": "user", "content": q}] for i, (t, q) in enumerate((t, q) for t in TOPICS for q in QUESTIONS)]


def run(engine, batch: list[list[dict]], tokens: int) -> list[tuple[list[int], list[float]]]:
    """Every conversation of `batch` at once; each one's (token ids, their logprobs)."""
    params = [engine.sampling_params(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=0) for _ in batch]
    ids = [engine.add_request(messages=m, params=p) for m, p in zip(batch, params)]
    out = {rid: ([], []) for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.logprobs)
    return [out[rid] for rid in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default=None, help="a package (default: the embedded SmolLM2-135M's)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--unshared", action="store_true", help="no two requests share a prompt prefix")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="the engine's step budget (chunked prefill)")
    args = ap.parse_args()
    from runtime.core.engine import Engine
    from runtime.resolve import resolve_package

    package = resolve_package(args.package)
    budget = {"max_batch_tokens": args.max_batch_tokens} if args.max_batch_tokens else {}
    convs = requests(shared=not args.unshared)
    solo_engine = Engine.from_package(package, threads=args.threads, speculative_tokens=0, **budget)
    solo = []
    for conv in convs:
        solo_engine.reset_prefix_cache()
        solo.extend(run(solo_engine, [conv], args.tokens))
    together = run(Engine.from_package(package, threads=args.threads, speculative_tokens=0, **budget), convs, args.tokens)
    tokens_differ = [i for i, (a, b) in enumerate(zip(solo, together)) if a[0] != b[0]]
    logprobs_differ = [i for i, (a, b) in enumerate(zip(solo, together)) if a[1] != b[1]]
    print(json.dumps({"requests": len(convs), "tokens_differ": len(tokens_differ), "logprobs_differ": len(logprobs_differ),
                      "differing": tokens_differ, "shared_prefixes": not args.unshared, "threads": args.threads, "max_batch_tokens": args.max_batch_tokens,
                      "paged_attention": os.environ.get("RUVLLM_PAGED_ATTENTION", "1")}))


if __name__ == "__main__":
    main()
