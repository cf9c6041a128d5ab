"""`python -m exporter eval`: how much a package's quantization costs, measured, not assumed.

Teacher-forced over a held-out text in one prefill per package: the next-token log-probabilities at
every position, their perplexity, and against a reference (usually the source's fp32 export) the mean
per-token KL(reference || package) and the top-1 agreement; beside them the package's size on disk and
its one-stream decode speed. The default text is CPython's own LICENSE.txt (the history of Python and its
licences, PSF licence, ~3.8k SmolLM2 tokens): English the project did not write, present wherever Python
is. A reference that is not a package (a Hugging Face folder or hub id, a .gguf, an alias) is exported
to fp32 first, into a temporary folder.

With --kv-dtype int8 the text goes through in steps of KV_CHUNK tokens, so that nearly every position
attends over keys and values read back from the (int8) KV pool, as a decode does; without --reference
the reference is then the same package with an fp32 pool, stepped the same way: the KL is what the KV
cache's precision alone costs.
"""

from __future__ import annotations

import json
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from exporter.progress import stage
from runtime.errors import PackageError

DEFAULT_TEXT = "CPython's LICENSE.txt (Python Software Foundation License)"
KV_CHUNK = 16  # tokens a step when the KV pool's precision is measured: one block


def held_out_text() -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")


def teacher_forced_logits(pkg_dir, ids: list[int], kv_dtype: str = "fp32", chunk: int | None = None) -> np.ndarray:
    """The raw next-token logits at every position: from one prefill step, or from steps of `chunk`
    tokens over a KV pool of `kv_dtype`."""
    from runtime.backends.native import NativeBackend
    from runtime.core.step_batch import Chunk, build_step
    from runtime.package import load_package

    backend = NativeBackend(load_package(pkg_dir), kv_dtype=kv_dtype)
    blocks = -(-len(ids) // 16)
    backend.allocate(blocks, 16)
    chunk = chunk or len(ids)
    out = []
    for start in range(0, len(ids), chunk):
        tokens = ids[start:start + chunk]
        n = len(tokens)
        # floor 0: on a two-tier int8 pool every position reads the block before its own exact, as generated
        # tokens do (a prompt's positions below its floor read their own block alone: kv_blocks.exact_floor)
        batch = build_step([Chunk(tokens=tokens, start=start, block_table=list(range(blocks)),
                                  kv_slots=list(range(start, start + n)), want_logits=True, exact_from=0)], 16,
                           want_full_logits=True)
        batch.logits_index = list(range(n))  # logits at every position, not only the last
        for name in ("temperature", "repetition_penalty"):
            setattr(batch, name, [1.0] * n)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(batch, name, [0.0] * n)
        batch.sparse_ids, batch.sparse_seen = [[0]] * n, [[0.0]] * n
        batch.sparse_counts, batch.sparse_bias = [[0.0]] * n, [[0.0]] * n
        out.append(backend.run(batch).logits.copy())
    return np.concatenate(out)


def teacher_forced_logprobs(pkg_dir, ids: list[int], kv_dtype: str = "fp32", chunk: int | None = None) -> np.ndarray:
    """log-softmax of the next-token logits at every position."""
    logits = teacher_forced_logits(pkg_dir, ids, kv_dtype, chunk).astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def perplexity(logprobs: np.ndarray, ids: list[int]) -> float:
    return float(np.exp(-np.mean([logprobs[i, ids[i + 1]] for i in range(len(ids) - 1)])))


def quality(ref: np.ndarray, test: np.ndarray, ids: list[int]) -> dict:
    """Mean KL(ref || test) per token, both perplexities and top-1 agreement."""
    kl = (np.exp(ref) * (ref - test)).sum(axis=1).mean()
    top1 = np.mean(ref.argmax(1) == test.argmax(1))
    return {"kl": kl, "ppl_ref": perplexity(ref, ids), "ppl": perplexity(test, ids), "top1": top1}


@dataclass
class Row:
    package: str
    quantization: str
    size_mb: float
    perplexity: float
    delta_ppl_pct: float | None = None
    kl: float | None = None
    top1: float | None = None
    decode_tok_s: float | None = None


def decode_speed(pkg_dir, tokens: int = 64, kv_dtype: str = "fp32") -> float:
    """One stream's greedy decode tok/s after bench's short chat prompt (the first token excluded), measured
    as `ruvllm bench` measures it."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams
    from runtime.serve.bench import SHORT_PROMPT, run_one

    engine = Engine.from_package(pkg_dir, verify=False, speculative_tokens=0, kv_dtype=kv_dtype)
    run_one(engine, SamplingParams(temperature=0.0, max_tokens=4), messages=SHORT_PROMPT)  # warm-up
    return run_one(engine, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                   messages=SHORT_PROMPT)["decode_tps"]


def _size_mb(pkg) -> float:
    return round(sum(f.stat().st_size for f in Path(pkg.path).iterdir() if f.is_file()) / 2**20, 1)


def _quant_label(pkg) -> str:
    q = pkg.manifest.get("quantization") or {}
    weights = q.get("weights", "fp32")
    return f"{weights} {q['method']}" if q.get("method") and weights not in ("fp32", "fp16") else weights


def evaluate(packages: list[str], reference: str | None = None, text: str | None = None, tokens: int = 2048,
             speed: bool = True, progress: bool = True, kv_dtype: str = "fp32") -> dict:
    """The eval table as a dict: {"text", "tokens", "reference", "kv_dtype", "rows": [Row, ...]}. With a
    kv_dtype other than fp32 and no reference, each package is measured against itself on an fp32 pool."""
    from runtime.package import load_package
    from runtime.text.tokenizer import Tokenizer

    loaded = [load_package(p) for p in packages]
    with tempfile.TemporaryDirectory(prefix="ruvllm-eval-") as tmp:
        ref_dir = _reference_package(reference, tmp, progress) if reference else None
        tok_pkg = load_package(ref_dir) if ref_dir else loaded[0]
        tok = Tokenizer.from_file(tok_pkg.file(tok_pkg.manifest["tokenizer"]["file"]), tok_pkg.manifest["tokenizer"])
        ids = tok.encode(text if text is not None else held_out_text())[:tokens]
        if len(ids) < 2:
            raise PackageError("the evaluation text has fewer than 2 tokens")
        ref = None
        if ref_dir:
            bar = stage("reference logits", total=1, enabled=progress)
            ref = teacher_forced_logprobs(ref_dir, ids)
            bar.update()
            bar.close()
        rows = []
        chunk = KV_CHUNK if kv_dtype != "fp32" else None
        for pkg in stage("packages", loaded, total=len(loaded), enabled=progress):
            lp = teacher_forced_logprobs(pkg.path, ids, kv_dtype, chunk)
            row = Row(str(pkg.path), _quant_label(pkg), _size_mb(pkg), round(perplexity(lp, ids), 4))
            base = ref if ref is not None or chunk is None else teacher_forced_logprobs(pkg.path, ids, "fp32", chunk)
            if base is not None:
                q = quality(base, lp, ids)
                row.kl, row.top1 = round(float(q["kl"]), 5), round(float(q["top1"]), 4)
                row.delta_ppl_pct = round(100 * (q["ppl"] / q["ppl_ref"] - 1), 2)
            if speed:
                row.decode_tok_s = round(decode_speed(pkg.path, kv_dtype=kv_dtype), 1)
            rows.append(row)
            del lp
        return {"text": "given" if text is not None else DEFAULT_TEXT, "tokens": len(ids), "kv_dtype": kv_dtype,
                "reference": reference or (None if chunk is None else "each package on an fp32 KV pool"),
                "reference_perplexity": round(perplexity(ref, ids), 4) if ref is not None else None,
                "rows": [asdict(r) for r in rows]}


def _reference_package(reference: str, tmp: str, progress: bool) -> str:
    """A package folder as it is; anything else exported to fp32 into `tmp`."""
    if (Path(reference) / "manifest.json").is_file():
        return reference
    from exporter.convert import ConvertOptions, convert

    return str(convert(reference, Path(tmp) / "reference-fp32", ConvertOptions(quant="fp32", lora=False,
                                                                            progress=progress)))


def format_table(result: dict) -> str:
    head = ["package", "quantization", "size MB", "perplexity", "Δ ppl", "KL", "top-1", "decode tok/s"]
    lines = [f"text: {result['text']}, {result['tokens']} tokens, teacher-forced, KV {result['kv_dtype']}"
             + (f"; reference {result['reference']}" if result["reference"] else "")
             + (f" (perplexity {result['reference_perplexity']})" if result["reference_perplexity"] else "")]
    rows = [[Path(r["package"]).name, r["quantization"], f"{r['size_mb']:.1f}", f"{r['perplexity']:.3f}",
             "" if r["delta_ppl_pct"] is None else f"{r['delta_ppl_pct']:+.2f}%",
             "" if r["kl"] is None else f"{r['kl']:.4f}", "" if r["top1"] is None else f"{100 * r['top1']:.1f}%",
             "" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"] for r in result["rows"]]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    for cells in [head, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(lines)


def main(args) -> None:
    text = None
    if args.text:
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise PackageError(f"cannot read --text {args.text}: {err}") from None
    result = evaluate(args.packages, args.reference, text, args.tokens, speed=not args.no_speed,
                      progress=not args.json, kv_dtype=args.kv_dtype)
    print(json.dumps(result) if args.json else format_table(result))
