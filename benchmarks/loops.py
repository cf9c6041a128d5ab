"""How often a model's chat answers fall into a loop, at the old demo defaults, the new ones and with DRY.

A loop: a sequence of 8+ tokens that occurs twice in one answer (the repeats small models fall into when
decoded greedily). 20 chat prompts, each answered up to 256 tokens by the native engine; the sampled
settings run each prompt under several seeds. Prints JSON.

    python benchmarks/loops.py [--package DIR] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "Write a haiku about the sea.", "Name the capital of France.", "Explain what a KV cache is in one paragraph.",
    "Write a short poem about autumn.", "What are three tips for staying focused while studying?",
    "Describe your ideal weekend.", "Write a limerick about a cat.", "Why is the sky blue?",
    "Give me a recipe for pancakes.", "Tell me a short story about a robot who learns to paint.",
    "What is photosynthesis?", "List five fruits and one fact about each.", "Write a thank-you note to a teacher.",
    "How do airplanes stay in the air?", "Summarize the plot of Romeo and Juliet.",
    "What should I pack for a camping trip?", "Write a motivational message for a Monday morning.",
    "Explain recursion to a child.", "Describe the water cycle.", "Write a song chorus about friendship.",
]
LOOP = 8  # tokens


def has_loop(tokens: list[int], n: int = LOOP) -> bool:
    seen = set()
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        if gram in seen:
            return True
        seen.add(gram)
    return False


def run(engine, settings: dict, seeds: list[int | None]) -> dict:
    """Every prompt under every seed, all queued at once (a row's tokens do not depend on its batch)."""
    requests = {}
    for prompt in PROMPTS:
        for seed in seeds:
            params = engine.sampling_params(**settings, max_tokens=256, seed=seed)
            rid = engine.add_request(messages=[{"role": "user", "content": prompt}], params=params)
            requests[rid] = prompt
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    loops = sum(has_loop(t) for t in tokens.values())
    return {"answers": len(tokens), "looping": loops, "looping_share": round(loops / len(tokens), 3),
            "mean_tokens": round(sum(map(len, tokens.values())) / len(tokens), 1),
            "hit_max_tokens": sum(len(t) >= 256 for t in tokens.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default=None, help="a package folder (default: the embedded SmolLM2-135M's)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per prompt for the sampled settings")
    args = ap.parse_args()
    from runtime.core.engine import Engine
    from runtime.resolve import resolve_package

    engine = Engine.from_package(resolve_package(args.package), speculative_tokens=0)
    seeds = list(range(args.seeds))
    report = {
        "package": engine.pkg.name, "model_defaults": engine.sampling_defaults, "loop_tokens": LOOP,
        "old_demo_defaults (greedy)": run(engine, {"temperature": 0.0}, [None]),
        "greedy + DRY 0.8": run(engine, {"temperature": 0.0, "dry_multiplier": 0.8}, [None]),
        "new defaults": run(engine, {}, seeds),
        "new defaults + DRY 0.8": run(engine, {"dry_multiplier": 0.8}, seeds),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
