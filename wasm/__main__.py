"""python -m wasm build [--out dist/web] [--model SOURCE ...] | serve [--port 8000]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.errors import RuvLLMError
from wasm.build import ROOT, build
from wasm.serve import make_server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m wasm", description="the offline browser bundle")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="assemble dist/web/")
    b.add_argument("--out", default=str(ROOT / "dist" / "web"))
    b.add_argument("--model", action="append", help="a model for the page (repeatable): an alias, a Hugging Face hub "
                   "id, a local folder or a .gguf file (default: smollm2-135m)")
    b.add_argument("--quant", default="int4", choices=["fp32", "int8", "int4"])
    b.add_argument("--no-model", action="store_true")
    s = sub.add_parser("serve", help="serve the bundle with cross-origin isolation headers")
    s.add_argument("--dir", default=str(ROOT / "dist" / "web"))
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        try:
            build(Path(args.out), None if args.no_model else args.model or ["smollm2-135m"], args.quant)
        except RuvLLMError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0
    root = Path(args.dir)
    if not (root / "index.html").exists():
        print(f"error: {root} has no bundle; run `python -m wasm build` first", file=sys.stderr)
        return 1
    server = make_server(root, args.host, args.port)
    print(f"RuvLLM demo: http://{args.host}:{args.port}/  (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
