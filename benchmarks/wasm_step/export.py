"""Export the embedded SmolLM2 GGUF for step.c (its own blocks, repacked, nothing requantized), the native
engine's logits for a prompt and its greedy continuation, then build step.wasm and run step.mjs in Node:

    python benchmarks/wasm_step/export.py --run

step.mjs (Node; with --browser also page.html in Chromium) prints the per-position KL and largest logit difference against the native engine (the same
Q4_1 / Q8_0 blocks with activations rounded per block of 32 on both sides), the greedy continuation's
agreement, and single-thread decode tok/s (issue 33: what a page backend without onnxruntime-web reaches).
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


def _q4_1(t, rows: int, cols: int) -> dict[str, np.ndarray]:
    raw = np.asarray(t.data, np.uint8).reshape(rows, cols // 32, 20)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    four = lambda a: np.ascontiguousarray(a.reshape(rows // 4, 4, cols // 32).transpose(0, 2, 1))  # noqa: E731
    return {"w": np.ascontiguousarray(raw[..., 4:]).reshape(rows, cols // 2), "d": four(d), "m": four(m)}


def export(out: Path, ctx: int, new_tokens: int) -> None:
    import gguf

    from runtime.aliases import embedded_gguf_path
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams
    from runtime.core.step_batch import Chunk, build_step

    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    field = lambda k: reader.fields[k].parts[-1][0]  # noqa: E731
    dim, layers = int(field("llama.embedding_length")), int(field("llama.block_count"))
    hidden, heads = int(field("llama.feed_forward_length")), int(field("llama.attention.head_count"))
    kv_heads, theta = int(field("llama.attention.head_count_kv")), float(field("llama.rope.freq_base"))
    eps, hd = float(field("llama.attention.layer_norm_rms_epsilon")), dim // heads
    embd = tensors["token_embd.weight"]
    vocab = int(embd.shape[1])
    raw = np.asarray(embd.data, np.uint8).reshape(vocab, dim // 32, 34)
    arrays: dict[str, np.ndarray] = {
        "embd": np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(vocab, dim),
        "embd_d": raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32),
        "out_norm": np.asarray(tensors["output_norm.weight"].data, np.float32),
    }
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    angle = np.arange(ctx, dtype=np.float64)[:, None] * inv[None, :]
    arrays["rope"] = np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32)
    shapes = {"q": (heads * hd, dim), "k": (kv_heads * hd, dim), "v": (kv_heads * hd, dim), "o": (dim, heads * hd),
              "gate": (hidden, dim), "up": (hidden, dim), "down": (dim, hidden)}
    names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
             "down": "ffn_down"}
    for i in range(layers):
        arrays[f"{i}.attn_norm"] = np.asarray(tensors[f"blk.{i}.attn_norm.weight"].data, np.float32)
        arrays[f"{i}.ffn_norm"] = np.asarray(tensors[f"blk.{i}.ffn_norm.weight"].data, np.float32)
        for key, (rows, cols) in shapes.items():
            t = tensors[f"blk.{i}.{names[key]}.weight"]
            assert t.tensor_type.name == "Q4_1", t.tensor_type.name
            for part, arr in _q4_1(t, rows, cols).items():
                arrays[f"{i}.{key}.{part}"] = arr
    manifest = {"config": {"dim": dim, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
                           "head_dim": hd, "vocab": vocab, "ctx": ctx, "eps": eps}, "arrays": []}
    with open(out / "weights.bin", "wb") as f:
        for name, arr in arrays.items():
            manifest["arrays"].append({"name": name, "dtype": str(arr.dtype), "offset": f.tell(), "bytes": arr.nbytes})
            f.write(np.ascontiguousarray(arr).tobytes())

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
    (out / "manifest.json").write_text(json.dumps(manifest))


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
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    export(args.out, args.ctx, args.new_tokens)
    if args.run:
        wasm = args.out / "step.wasm"
        subprocess.run([sys.executable, "-m", "ziglang", "cc", "--target=wasm32-freestanding", "-O3", "-msimd128", "-mrelaxed-simd",
                        "-nostdlib", "-Wl,--no-entry", "-Wl,--export-dynamic", "-o", str(wasm), str(HERE / "step.c")],
                       check=True)
        subprocess.run(["node", "--experimental-wasm-relaxed-simd", str(HERE / "step.mjs"), str(args.out)], check=True)
        if args.browser:
            print(json.dumps(in_chromium(args.out)))


def in_chromium(out: Path, timeout_s: int = 300) -> dict:
    """page.html in headless Chromium (/usr/bin/chromium), served with the data; its window.result."""
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(HERE.parents[1]))
    from wasm.serve import serve_in_thread

    server, base = serve_in_thread(out, {"/code/": HERE})
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"], headless=True)
            page = browser.new_page()
            page.goto(base + "code/page.html")
            page.wait_for_function("window.result", timeout=timeout_s * 1000)
            result = page.evaluate("window.result")
            browser.close()
            return result
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
