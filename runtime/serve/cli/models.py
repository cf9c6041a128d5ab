"""`ruvllm list`, `info` and `download`: the packages in the cache and what this host runs them on."""

from __future__ import annotations

import json

from runtime.aliases import cache_dir, cached_package_dir
from runtime.errors import RuvLLMError
from runtime.resolve import export_into_cache, resolve_package


def cmd_list(args) -> int:
    root = cache_dir() / "packages"
    rows = []
    if root.exists():
        for d in sorted(root.iterdir()):
            m = d / "manifest.json"
            if not m.exists():
                continue
            try:
                man = json.loads(m.read_text())
                size = sum(int(f["size"]) for f in man["files"].values())
                rows.append((d, man, size))
            except (json.JSONDecodeError, KeyError, ValueError):
                rows.append((d, None, 0))
    if not rows:
        print(f"no packages in {root} (ruvllm download ALIAS adds one)")
        return 0
    for d, man, size in rows:
        if man is None:
            print(f"{d.name:<40} (corrupt manifest)")
        elif args.long:
            print(f"{d.name:<40} {size / 1e6:8.1f} MB  {man['architecture']:<8} {man['quantization']['weights']:<5} "
                  f"{man['provenance']['source']}  {d}")
        else:
            print(f"{d.name:<40} {size / 1e6:8.1f} MB")
    return 0


def cmd_info(args) -> int:
    from runtime.package import load_package
    from runtime.serve.personalization import package_root, stored_users

    pkg = load_package(resolve_package(args.package))
    m = pkg.manifest
    cfg = m["config"]
    info = {
        "name": pkg.name, "path": str(pkg.path), "architecture": m["architecture"],
        "parameters": cfg["num_parameters"], "quantization": m["quantization"], "target": m["target"],
        "context_length": cfg["max_positions"], "vocab_size": cfg["vocab_size"],
        "layers": cfg["num_layers"], "hidden_size": cfg["hidden_size"],
        "attention_heads": cfg["num_heads"], "kv_heads": cfg["num_kv_heads"],
        "features": {
            "paged_kv": True, "kv_block_size": m["kv_cache"]["block_size"], "prefix_sharing": True,
            "in_graph_logits_processing": True, "lora": bool(m.get("lora")),
            "lora_targets": (m.get("lora") or {}).get("targets", []), "chat_template": bool(m.get("chat_template")),
        },
        "files": {k: v["size"] for k, v in m["files"].items()},
        "size_bytes": pkg.size_bytes(), "source": m["provenance"]["source"],
        "host": host_info(pkg, args.device, args.kv_dtype or "fp32"),
        "personalization": stored_users(package_root(pkg, args.state_dir)),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['name']}  [{pkg.path}]")
    print(f"  architecture   {info['architecture']}, {cfg['num_parameters'] / 1e6:.1f}M parameters")
    print(f"  shape          {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, heads {cfg['num_heads']}"
          f" (kv {cfg['num_kv_heads']}), vocab {cfg['vocab_size']}, context {cfg['max_positions']}")
    q = m["quantization"]
    rescore = q.get("lm_head_rescore")
    print(f"  quantization   weights {q['weights']}, embeddings {q['embeddings']}, lm_head {q['lm_head']}"
          + (f" (best {rescore['top']} rescored from {rescore['from']})" if rescore else "")
          + (f", {q['method'].upper()} in blocks of {q['block_size']}" if "block_size" in q else "")
          + (f" ({q['mlp_block_size']} in the MLP)" if "mlp_block_size" in q else "")
          + (f" (calibrated on {q['calibration']})" if q.get("calibration") else ""))
    print(f"  target         {m['target']}")
    f = info["features"]
    print(f"  features       paged KV (block {f['kv_block_size']}), prefix sharing, in-graph sampling,"
          f" LoRA {'(' + ', '.join(f['lora_targets']) + ')' if f['lora'] else 'no'},"
          f" chat template {'yes' if f['chat_template'] else 'no'}")
    print(f"  source         {info['source']}")
    users = info["personalization"]
    print(f"  users          {users['users']} with their own adapter"
          + (f" ({users['feedbacks']} feedbacks, {users['tokens']} tokens learned)" if users["users"] else "")
          + f" in {users['state_dir']}")
    print("  files          " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in info["files"].items()))
    h = info["host"]
    if "error" in h:
        print(f"  on this host   cannot open it: {h['error']}")
    else:
        print(f"  on this host   {h['device']}, KV {h['kv_dtype']}: projections on {h['matmul_kernel']}, "
              f"attention on {h['attention_kernel']}")
        print(f"  KV pool        {h['kv_bytes_per_token']:,} bytes a token, {h['kv_tokens_per_gb']:,} tokens a GB "
              f"({h['kv_vs_fp32']}x fp32's; exact tails apart)")
        if h["kv_tail_bytes_a_sequence"]:
            print(f"  KV tails       {h['kv_tail_bytes_a_sequence']:,} bytes a sequence at most (fp16); with them, "
                  f"sequences of 512 tokens hold {h['kv_vs_fp32_at_512']}x fp32's tokens a GB")
        print("  batch invariant yes: a request's tokens do not depend on what runs beside it" if h["batch_invariant"]
              else f"  batch invariant no ({h['batch_invariance']}); --batch-invariant serves one request at a time")
    return 0


def host_info(pkg, device: str, kv_dtype: str) -> dict:
    """What this host runs the package on (its graph opened, no KV pool): the kernels, whether a request's
    numbers depend on its batch (issue 50: the same answer the server's /v1/models gives), and the KV
    pool's bytes a token (the cold rows and their scales), and what the exact tails add a sequence (at
    most kv_tails.TAIL_BLOCKS blocks), and both together at 512 tokens a sequence (issue 52's measure)."""
    from runtime.backends.native import NativeBackend
    from runtime.core.kv_blocks import kv_bytes_per_token, kv_tail_bytes
    from runtime.core.kv_tails import TAIL_BLOCKS

    try:
        backend = NativeBackend(pkg, device=device, kv_dtype=kv_dtype)
    except RuvLLMError as err:
        return {"device": device, "kv_dtype": kv_dtype, "error": str(err)}
    fp32 = kv_bytes_per_token(pkg.config, "fp32")
    per_token = backend.kv_bytes_per_token(pkg.config)
    two_tier = backend.two_tier  # tails only where ruvllm.PagedAttention reads the pool
    tails = kv_tail_bytes(pkg.config, kv_dtype, int(pkg.manifest["kv_cache"]["block_size"]), TAIL_BLOCKS) if two_tier else 0
    info = backend.info()
    return {"device": device, "kv_dtype": kv_dtype, "matmul_kernel": info.matmul_kernel,
            "attention_kernel": info.attention_kernel, "batch_invariant": info.batch_invariant,
            "batch_invariance": info.batch_invariance, "kv_bytes_per_token": per_token,
            "kv_tokens_per_gb": int(2**30 // per_token), "kv_vs_fp32": round(fp32 / per_token, 2),
            "kv_tail_bytes_a_sequence": tails,
            "kv_vs_fp32_at_512": round(512 * fp32 / (512 * per_token + tails), 2)}


def cmd_download(args) -> int:
    target = cached_package_dir(args.source, args.quant, args.target, args.method, args.block_size)
    if (target / "manifest.json").exists() and not args.force:
        print(f"{args.source} ({args.quant}) is already in the cache: {target}")
        return 0
    extra = (("--method", args.method) if args.method else ()) + \
        (("--block-size", str(args.block_size)) if args.block_size else ())
    export_into_cache(args.source, args.quant, target, target=args.target, extra=extra)
    print(f"{args.source} ({args.quant}) -> {target}")
    return 0
