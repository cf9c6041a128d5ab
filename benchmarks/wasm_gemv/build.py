"""Build gemv.wasm (one-row int8/int4 projections in WASM SIMD) with zig cc from the PyPI package
`ziglang` (`pip install ziglang`; no other wasm32 compiler is needed), then time it in Node:

    python benchmarks/wasm_gemv/build.py --bench

Node 20 needs --experimental-wasm-relaxed-simd for the relaxed-dot variant (Chromium has it on).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLAGS = ["--target=wasm32-freestanding", "-O3", "-msimd128", "-mrelaxed-simd", "-nostdlib", "-Wl,--no-entry",
         "-Wl,--export-dynamic"]


def build(out: Path) -> Path:
    try:
        import ziglang  # noqa: F401
    except ImportError:
        sys.exit("needs the ziglang package: pip install ziglang")
    subprocess.run([sys.executable, "-m", "ziglang", "cc", *FLAGS, "-o", str(out), str(HERE / "gemv.c")], check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", type=Path, default=HERE / "gemv.wasm")
    ap.add_argument("--bench", action="store_true", help="then time it in Node (bench.mjs)")
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args()
    wasm = build(args.out)
    if args.bench:
        subprocess.run(["node", "--experimental-wasm-relaxed-simd", str(HERE / "bench.mjs"), str(wasm),
                        str(args.repeats)], check=True)


if __name__ == "__main__":
    main()
