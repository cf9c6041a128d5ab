"""Teacher-forced quality of packages against a reference package (usually the source's fp32 export).

    python benchmarks/quality.py REF_PKG PKG [PKG ...] [--text FILE] [--tokens N]

For each package: mean KL(reference || package) of the next-token distributions, perplexity against
the reference's, and top-1 agreement, over the first N tokens of the text, in one prefill each. The
default text is CPython's own LICENSE.txt (its history and licences, ~3.8k SmolLM2 tokens): English the
project did not write, present wherever Python is. Prints one JSON object per package.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.package import load_package  # noqa: E402
from runtime.text.tokenizer import Tokenizer  # noqa: E402
from tests.exporter.test_quantization import quality, teacher_forced_logprobs  # noqa: E402


def held_out_text() -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference")
    ap.add_argument("packages", nargs="+")
    ap.add_argument("--text", help="UTF-8 text file (default: CPython's LICENSE.txt)")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    ref_pkg = load_package(args.reference)
    tok = Tokenizer.from_file(ref_pkg.file("tokenizer.json"), ref_pkg.manifest["tokenizer"])
    text = Path(args.text).read_text(encoding="utf-8") if args.text else held_out_text()
    ids = tok.encode(text)[:args.tokens]
    ref = teacher_forced_logprobs(args.reference, ids)
    for pkg in args.packages:
        q = quality(ref, teacher_forced_logprobs(pkg, ids), ids)
        print(json.dumps({"package": pkg, "tokens": len(ids), **{k: round(float(v), 5) for k, v in q.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
