"""`python -m exporter convert|adapter|eval|inspect`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from runtime.contract import KV_DTYPES
from runtime.errors import RuvLLMError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m exporter", description="Export Hugging Face models to RuvLLM packages")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="export a hub id, local folder, .gguf file or alias to a model package")
    c.add_argument("source")
    c.add_argument("-o", "--output", required=True, help="package folder to write")
    c.add_argument("--quant", default=None, choices=["fp32", "fp16", "int8", "int4", "w8a8"],
                   help="default: fp32, or int4 for --target wasm/webgpu (int4 on the wire, fp32 compute). "
                        "w8a8: int8 weights and per-row int8 activations, for many streams at once (faster "
                        "there than int4, slower for one stream; native targets)")
    c.add_argument("--block-size", type=int, default=None,
                   help="quantization block size (int8/int4; default 64 for int4 with AWQ or GPTQ, else 32)")
    c.add_argument("--mlp-block-size", type=int, default=None,
                   help="the MLP projections' own block size (three quarters of the weights; default: --block-size). "
                        "128 with AWQ's 64: a step 5-11%% faster, a little further from fp32 (docs/PERFORMANCE.md)")
    c.add_argument("--method", default=None, choices=["rtn", "awq", "gptq", "awq+gptq", "hqq", "smoothquant"],
                   help="int8/int4 weight quantization: round to nearest; AWQ (activation-aware scales and "
                        "clipping searched on calibration text; ~2 minutes more for SmolLM2, closer to fp32); GPTQ "
                        "(rounding that corrects each column's error on calibration inputs, layer by layer; ~1 "
                        "minute more); AWQ then GPTQ; or HQQ (zero points solved without calibration data, kept as float "
                        "minimums; seconds); with --quant w8a8, SmoothQuant (activation outliers moved into the weights). "
                        "Default: awq for int4, rtn for int8 and w8a8")
    c.add_argument("--calibration", default=None, metavar="FILE",
                   help="UTF-8 text for AWQ's and GPTQ's calibration (default: Python's standard library docs)")
    c.add_argument("--layerwise", action="store_const", const=True, default=None,
                   help="AWQ/GPTQ one decoder layer at a time, the source read tensor by tensor (memory: one layer "
                        "in float); the default when the model's fp32 weights exceed a quarter of this machine's "
                        "memory. GPTQ then calibrates on the calibration text alone")
    c.add_argument("--head-quant", default=None, choices=["int8", "int4"],
                   help="LM head precision with --quant int8/int4 (default: int4 with --head-rescore for int4 "
                        "models with tied embeddings on native targets, else int8)")
    c.add_argument("--head-rescore", type=int, default=None, metavar="K",
                   help="score the int4/int8 LM head's K best tokens again from the fp16 embedding table "
                        "(tied embeddings, native targets; default 32 where the head defaults to int4, 0 = off)")
    c.add_argument("--kv-block-size", type=int, default=16, help="default KV-cache block size in tokens")
    c.add_argument("--target", default="cpu", choices=["cpu", "wasm", "webgpu", "cuda"])
    c.add_argument("--max-context", type=int, default=None, help="cap the context length (rotary table size)")
    c.add_argument("--no-lora", action="store_true", help="skip the LoRA graph variant")
    c.add_argument("--quiet", action="store_true")
    a = sub.add_parser("adapter", help="convert a PEFT LoRA folder into the package's adapter format, or export a "
                       "user's learned adapter (--user) as a PEFT folder")
    a.add_argument("peft_dir", nargs="?")
    a.add_argument("--user", default=None, help="export this user's adapter (serve --personalize, chat --user) as PEFT "
                   "writes one, to train it further elsewhere")
    a.add_argument("--key", default=None, help="the API key name the user came with (default: local, chat --user's; "
                   "anonymous for a server without keys)")
    a.add_argument("--state-dir", default=None, help="where users' adapters are kept (default: the cache's users/)")
    a.add_argument("-o", "--output", required=True, help="adapter folder to write")
    a.add_argument("--base", required=True, help="the model package the adapter will run on (checked against it)")
    a.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"], help="stored precision (fp16: half the bytes)")
    a.add_argument("--max-lora-rank", type=int, default=None, help="refuse adapters of a larger rank (default 16)")
    e = sub.add_parser("eval", help="quality of packages: perplexity, KL and top-1 against a reference, size, speed")
    e.add_argument("packages", nargs="+", metavar="PKG")
    e.add_argument("--reference", default=None, metavar="PKG_OR_SOURCE",
                   help="a package, or a source exported to fp32 for the comparison (HF folder or id, .gguf, alias)")
    e.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text (default: CPython's LICENSE.txt)")
    e.add_argument("--tokens", type=int, default=2048, help="tokens of the text to use (default 2048)")
    e.add_argument("--kv-dtype", default="fp32", choices=list(KV_DTYPES),
                   help="the KV pool's precision; int8 or int4 without --reference: KL against the same package on fp32 KV")
    e.add_argument("--no-speed", action="store_true", help="skip the decode tok/s column")
    e.add_argument("--json", action="store_true")
    i = sub.add_parser("inspect", help="summarize a package: manifest and graph inputs/outputs")
    i.add_argument("package")
    i.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "convert":
            from exporter.convert import BROWSER_TARGETS, ConvertOptions, convert

            quant = args.quant or ("int4" if args.target in BROWSER_TARGETS else "fp32")
            opts = ConvertOptions(quant=quant, block_size=args.block_size, mlp_block_size=args.mlp_block_size,
                                  method=args.method,
                                  calibration=args.calibration, head_quant=args.head_quant,
                                  head_rescore=args.head_rescore, kv_block_size=args.kv_block_size,
                                  target=args.target, lora=not args.no_lora, max_context=args.max_context,
                                  progress=not args.quiet, layerwise=args.layerwise)
            out = convert(args.source, args.output, opts)
            print(f"wrote {out}")
        elif args.cmd == "adapter" and args.user:
            from exporter.adapter import export_user_adapter

            if args.peft_dir:
                ap.error("--user exports a user's adapter: give no PEFT folder")
            out = export_user_adapter(args.user, args.key or "local", args.state_dir, args.base, args.output)
            print(f"wrote {out}")
        elif args.cmd == "adapter":
            from exporter.adapter import convert_adapter
            from runtime.core.adapters import DEFAULT_MAX_LORA_RANK

            if not args.peft_dir:
                ap.error("adapter needs a PEFT folder (or --user NAME)")
            out = convert_adapter(args.peft_dir, args.base, args.output, args.dtype,
                                  args.max_lora_rank or DEFAULT_MAX_LORA_RANK)
            print(f"wrote {out}")
        elif args.cmd == "eval":
            from exporter.evaluate import main as evaluate_main

            evaluate_main(args)
        else:
            inspect_package(args.package, args.json)
    except RuvLLMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def inspect_package(path: str, as_json: bool) -> None:
    from runtime.package import load_package

    pkg = load_package(path)
    m = pkg.manifest
    if as_json:
        print(json.dumps(m, indent=2))
        return
    cfg = m["config"]
    print(f"{pkg.name}  ({m['architecture']}, {cfg['num_parameters'] / 1e6:.1f}M parameters, "
          f"{m['quantization']['weights']}, target {m['target']})")
    print(f"  layers {cfg['num_layers']}, hidden {cfg['hidden_size']}, heads {cfg['num_heads']}/{cfg['num_kv_heads']} "
          f"x {cfg['head_dim']}, vocab {cfg['vocab_size']}, context {cfg['max_positions']}")
    print(f"  KV: paged, block size {m['kv_cache']['block_size']}; LoRA: "
          f"{', '.join(m['lora']['targets']) if m.get('lora') else 'no'}")
    print(f"  source: {m['provenance']['source']}  (exporter {m['provenance']['exporter_version']})")
    print("  inputs:")
    for inp in m["io"]["inputs"]:
        if inp["name"].startswith("past.") and not inp["name"].startswith("past.0."):
            continue
        print(f"    {inp['name']:<24} {inp['shape']}")
    print(f"    (past.N.key / past.N.value for N < {cfg['num_layers']})")
    print("  outputs: " + ", ".join(o for o in m["io"]["outputs"] if not o.startswith("present.") or o.startswith("present.0.")))
    print("  files:")
    for name, f in m["files"].items():
        print(f"    {name:<24} {int(f['size']) / 1e6:9.1f} MB")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
