"""Export the embedded SmolLM2 GGUF for the page's WASM step (wasm/step/step.c: its own blocks, repacked by
exporter/step_weights.py, nothing requantized), the native engine's logits for a prompt and its greedy
continuation, then build step.wasm and run step.mjs in Node:

    python benchmarks/wasm_step/export.py --run

step.mjs (Node; with --browser also page.html in Chromium), on one thread and on --threads, prints the
per-position KL and largest logit difference against the native engine (the same Q4_1 / Q8_0 blocks with
activations rounded per block of 32 on both sides), the greedy continuation's agreement, and decode tok/s
(issue 33: what a page backend without onnxruntime-web reaches).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type with an oil-based ink and a screw press.")


def export(out: Path, ctx: int, new_tokens: int) -> None:
    from exporter.step_weights import write_step_weights
    from runtime.aliases import embedded_gguf_path
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams
    from runtime.core.step_batch import Chunk, build_step

    manifest = write_step_weights(embedded_gguf_path(), out, ctx)
    engine = Engine.from_package(str(_default_package()), verify=False)
    ids = engine.encode_prompt(PROMPT)
    table = list(range(-(-(len(ids) + new_tokens) // engine.block_size)))
    bs = engine.block_size
    slots = [table[p // bs] * bs + p % bs for p in range(len(ids))]
    batch = build_step([Chunk(ids, 0, table, slots, True, logits_rows=len(ids), top_k=5)], bs, want_full_logits=True)
    logits = np.asarray(engine.backend.run(batch).logits, np.float32)
    fresh = Engine.from_package(str(_default_package()), verify=False, speculative_tokens=0)
    greedy = [t for o in fresh.generate(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
              for t in o.token_ids]
    logits.tofile(out / "logits.bin")
    manifest.update(prompt_ids=ids, greedy=greedy, logits_rows=int(logits.shape[0]))
    (out / "manifest.json").write_text(json.dumps(manifest))  # step.json's index, the prompt and the references


def _default_package() -> Path:
    from runtime.aliases import cached_package_dir

    pkg = cached_package_dir("smollm2-135m", "int4")
    if not pkg.exists():
        sys.exit(f"{pkg} is missing: run `python -m runtime download smollm2-135m` first")
    return pkg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/wasm_step"))
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--run", action="store_true", help="then build step.wasm and run step.mjs in Node")
    ap.add_argument("--browser", action="store_true", help="and run it in Debian's Chromium too (page.html)")
    ap.add_argument("--threads", type=int, default=2, help="also run with this many threads (step-threads.wasm)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    export(args.out, args.ctx, args.new_tokens)
    if args.run:
        sys.path.insert(0, str(HERE.parents[1]))
        from wasm.step_module import build

        build(args.out / "step.wasm")
        build(args.out / "step-threads.wasm", threads=True)
        # --no-liftoff: Node 20's baseline compiler gets relaxed_dot wrong (wasm/step/blocks.h)
        for threads in sorted({1, args.threads}):
            subprocess.run(["node", "--experimental-wasm-relaxed-simd", "--no-liftoff", str(HERE / "step.mjs"), str(args.out),
                            str(threads)], check=True)
        if args.browser:
            for threads in sorted({1, args.threads}):
                print(json.dumps(in_chromium(args.out, threads=threads)))


def in_chromium(out: Path, timeout_s: int = 300, threads: int = 1) -> dict:
    """page.html in headless Chromium (/usr/bin/chromium), served with the data, on the page's main thread
    (and threads - 1 helper workers); its window.result."""
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(HERE.parents[1]))
    from wasm.serve import serve_in_thread

    # at their repository paths, so that step_lib.mjs imports web/src/wasm_step.js by the same relative path
    server, base = serve_in_thread(out, {"/benchmarks/wasm_step/": HERE, "/web/": HERE.parents[1] / "web"})
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"], headless=True)
            page = browser.new_page()
            page.goto(base + f"benchmarks/wasm_step/page.html?threads={threads}")
            page.wait_for_function("window.result", timeout=timeout_s * 1000)
            result = page.evaluate("window.result")
            browser.close()
            return result
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
