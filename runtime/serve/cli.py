"""`ruvllm` (= `python -m runtime`): generate, chat, list, info, download, bench, serve."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from runtime.aliases import (
    ALIASES,
    cache_dir,
    cached_package_dir,
)
from runtime.contract import KV_DTYPES
from runtime.core.sampling import SamplingParams, check_range, range_text
from runtime.errors import RuvLLMError
from runtime.resolve import export_into_cache, resolve_package
from runtime.serve.api_keys import KEY_FILE_HELP


def parse_size(text: str) -> int:
    """'512MB', '1GB', '2048' (bytes) -> bytes."""
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "K": 2**10, "M": 2**20, "G": 2**30, "B": 1}
    t = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            number, scale = t[: -len(unit)], units[unit]
            break
    else:
        number, scale = t, 1
    try:
        value = float(number) * scale
    except ValueError:
        raise RuvLLMError(f"cannot read the size {text!r} (use e.g. 512MB or 1GB)") from None
    if value <= 0:
        raise RuvLLMError(f"the size {text!r} must be positive")
    return int(value)


def engine_options(args) -> dict:
    opts = {}
    if getattr(args, "kv_memory", None):
        opts["kv_memory"] = parse_size(args.kv_memory)
    if getattr(args, "num_blocks", None):
        opts["num_blocks"] = args.num_blocks
    if getattr(args, "block_size", None):
        opts["block_size"] = args.block_size
    if getattr(args, "kv_dtype", None):
        opts["kv_dtype"] = args.kv_dtype
    for name in ("speculative_tokens", "speculative_max_batch", "max_loras", "max_lora_rank", "max_cpu_loras"):
        if getattr(args, name, None) is not None:
            opts[name] = getattr(args, name)
    if getattr(args, "batch_invariant", False):
        opts["batch_invariant"] = True
    if getattr(args, "no_verify", False):
        opts["verify"] = False
    return opts


def make_engine(args, **kwargs):
    try:
        from runtime.core.engine import Engine
        pkg = resolve_package(getattr(args, "package", None), quiet=getattr(args, "json", False),
                              isq=getattr(args, "isq", None))
        return Engine.from_package(pkg, device=args.device, threads=getattr(args, "threads", None),
                                   **engine_options(args), **kwargs)
    except ImportError as err:
        raise RuvLLMError(f"the native backend needs numpy and onnxruntime ({err.name} is missing): "
                          "pip install 'ruvllm[native]'") from err


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop", "logprobs", "dry_multiplier", "dry_base", "dry_allowed_length",
                  "dry_penalty_last_n", "dry_sequence_breakers")


def sampling_given(args) -> dict:
    """The sampling flags given on the command line (the rest are the model's: generation_defaults)."""
    return {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name, None) is not None}


def sampling_from(args, engine=None) -> SamplingParams:
    """The flags given over `engine`'s defaults (the model's generation settings, else chat defaults);
    without an engine, over SamplingParams' own: a check of the flags before anything loads."""
    given = sampling_given(args)
    params = engine.sampling_params(**given) if engine is not None else SamplingParams(**given)
    params.validate()
    if getattr(args, "json_schema", None):
        params.constraint = json_schema_file(args.json_schema)
    return params


def json_schema_file(path: str):
    """--json-schema FILE as a structured-output Constraint; RuvLLMError when the file is not JSON."""
    from runtime.core.constraints import Constraint

    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RuvLLMError(f"--json-schema {path}: not a readable JSON file ({err})") from None
    return Constraint("json_schema", schema)


# ---- commands ----
def cmd_generate(args) -> int:
    if args.prompt is None:  # one positional given: it is the prompt
        args.package, args.prompt = None, args.package
    if args.prompt is None:
        raise RuvLLMError('generate needs a prompt: ruvllm generate "Why is the sky blue?"')
    if args.chat and args.raw:
        raise RuvLLMError("--chat and --raw: choose one")
    sampling_from(args)  # the flags are checked before anything loads
    engine = make_engine(args)
    params = sampling_from(args, engine)
    # a chat model gets a chat message, as llama-cli and Ollama send one; --raw sends the text as it is
    chat = args.chat or (not args.raw and engine.chat_template is not None)
    from runtime.serve.reasoning_print import ReplyPrinter

    adapter = add_lora(engine, args)
    started = time.perf_counter()
    prompt = engine.encode_prompt(messages=[{"role": "user", "content": args.prompt}]) if chat else args.prompt
    printer = ReplyPrinter(engine, prompt if chat else [], write=not args.json)  # a reasoning model's thinking, dimmed
    first = None
    ids, last, logprobs = [], None, []
    for out in engine.generate(prompt, params=params, adapter=adapter):
        logprobs.extend({"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in out.logprobs)
        if first is None:
            first = time.perf_counter()
        printer.feed(out.delta, out.token_ids)
        ids.extend(out.token_ids)
        last = out
    printer.close()
    end = time.perf_counter()
    if args.json:
        n = last.completion_tokens if last else 0
        print(json.dumps({
            "text": "".join(printer.answer), **({"reasoning": "".join(printer.thought)} if printer.split else {}),
            "token_ids": ids, "prompt_tokens": last.prompt_tokens if last else 0,
            "completion_tokens": n, "finish_reason": last.finish_reason if last else None,
            "ttft_ms": round((first - started) * 1000, 1) if first else None,
            "decode_tokens_per_s": round((n - 1) / (end - first), 1) if first and n > 1 and end > first else None,
            **({"logprobs": logprobs} if params.logprobs is not None else {}),
        }))
    else:
        sys.stdout.write("\n")
    return 0


CHAT_HELP = """commands:
  /help            this help
  /clear           forget the conversation
  /system PROMPT   set the system prompt (and clear)
  /temp VALUE      set the temperature
  /good, /bad      rate the last answer (with --user: the adapter learns from it)
  /prefer TEXT     the answer you wanted to the last question (with --user)
  /forget          reset your adapter (with --user)
  /quit, /exit     leave"""


def personal_args(p, serve: bool) -> None:
    """How users' adapters learn (runtime/serve/personalization.py)."""
    g = p.add_argument_group("per-user adaptation (each user's own LoRA, learned from their feedback)")
    if serve:
        g.add_argument("--personalize", action="store_true",
                       help="serve each request's `user` their own adapter; POST /v1/feedback teaches it, DELETE "
                            "/v1/users/NAME resets it")
    g.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where users' adapters are kept (default: the cache's users/)")
    from runtime.serve.personalization import PersonalSettings as S  # the defaults, said once

    g.add_argument("--personalize-targets", default=",".join(S.targets), metavar="T,T",
                   help="projections a user's adapter adapts (default: all seven)")
    g.add_argument("--personalize-rank", type=int, default=S.rank, help="a user's adapter rank (1-16, default %(default)s)")
    g.add_argument("--personalize-layers", type=float, default=S.top_layers, metavar="SHARE",
                   help="the share of the layers a user's adapter adapts, the last ones (default 1/3; 1: all)")
    g.add_argument("--personalize-lr", type=float, default=S.lr, help="the instant loop's Adam step, as a share of each adapted projection's weight RMS")
    g.add_argument("--personalize-epochs", type=int, default=S.epochs, help="passes over each feedback")
    g.add_argument("--personalize-ewc", type=float, default=S.ewc,
                   help="EWC++ strength against forgetting (0: off; default %(default)s)")


def personal_settings(args):
    from runtime.serve.personalization import PersonalSettings

    try:
        return PersonalSettings(targets=tuple(t.strip() for t in args.personalize_targets.split(",") if t.strip()),
                                rank=args.personalize_rank, top_layers=args.personalize_layers,
                                lr=args.personalize_lr,
                                epochs=max(1, args.personalize_epochs), ewc=args.personalize_ewc)
    except ValueError as err:
        raise RuvLLMError(str(err)) from None


def add_lora(engine, args) -> str | None:
    """--lora PATH: the adapter every request of generate / chat runs on."""
    if not getattr(args, "lora", None):
        return None
    return engine.adapters.add("lora", args.lora).name


def cmd_chat(args) -> int:
    from runtime.serve.reasoning_print import ReplyPrinter

    sampling_from(args)  # the flags are checked before anything loads
    engine = make_engine(args)
    params = sampling_from(args, engine)
    adapter = add_lora(engine, args)
    me = None
    if args.user:
        if adapter:
            raise RuvLLMError("--user learns the user's own adapter; it does not combine with --lora")
        from runtime.serve.personalization import LocalUser

        me = LocalUser(engine, args.user, personal_settings(args), args.state_dir)
    system = args.system
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    print(f"ruvllm chat: {engine.pkg.name} ({engine.pkg.manifest['quantization']['weights']}). /help for commands."
          + (f" Learning from {args.user}'s messages." if me else ""))
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print()
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, rest = line.partition(" ")
            if cmd in ("/quit", "/exit"):
                break
            if cmd == "/help":
                print(CHAT_HELP)
            elif cmd == "/clear":
                history = []
                print("(conversation cleared)")
            elif cmd == "/system":
                system = rest.strip() or None
                history = []
                print(f"(system prompt {'set' if system else 'removed'}; conversation cleared)")
            elif cmd == "/temp":
                try:
                    value = float(rest)
                    check_range("temperature", value)
                    params.temperature = value
                    print(f"(temperature {value})")
                except (ValueError, RuvLLMError):
                    print(f"usage: /temp VALUE (temperature {range_text('temperature')})")
            elif me is not None and cmd in ("/good", "/bad", "/prefer", "/forget"):
                personal_command(me, cmd, rest, history, system)
            else:
                print(f"unknown command {cmd}; /help lists them")
            continue
        if me is not None:
            adapter = me.adapter
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        printer = None
        try:
            ids = engine.encode_prompt(messages=messages)
            printer = ReplyPrinter(engine, ids)  # a reasoning model's thinking, dimmed; only the answer is kept
            for out in engine.generate(ids, params=SamplingParams(**vars(params)), adapter=adapter):
                printer.feed(out.delta, out.token_ids)
        except KeyboardInterrupt:
            pass
        except RuvLLMError as err:
            history.pop()
            print(f"error: {err}")
            continue
        if printer is not None:
            printer.close()
        print()
        history.append({"role": "assistant", "content": "".join(printer.answer) if printer else ""})
        if me is not None:  # the user's own writing: their words, their subjects
            learned = me.learn({"kind": "text", "text": line})
            print(f"(learned from your message: version {learned['version']}, {learned['seconds']:.1f} s)",
                  file=sys.stderr)
    return 0


def personal_command(me, cmd: str, rest: str, history: list[dict], system: str | None) -> None:
    """/good and /bad rate the last answer, /prefer TEXT gives the answer wanted, /forget resets the user."""
    if cmd == "/forget":
        print("(your adapter is reset)" if me.forget() else "(nothing was learned yet)")
        return
    if len(history) < 2 or history[-1]["role"] != "assistant":
        print("(no answer to rate yet)")
        return
    messages = ([{"role": "system", "content": system}] if system else []) + history[:-1]
    if cmd == "/prefer":
        if not rest.strip():
            print("usage: /prefer THE ANSWER YOU WANTED")
            return
        what = {"kind": "preferred", "messages": messages, "answer": rest.strip()}
        history[-1] = {"role": "assistant", "content": rest.strip()}
    else:
        what = {"kind": "rating", "messages": messages, "answer": history[-1]["content"],
                "rating": 1.0 if cmd == "/good" else -1.0}
    learned = me.learn(what)
    print(f"(learned: version {learned['version']}, {learned['seconds']:.1f} s)")


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


def cmd_bench(args) -> int:
    from runtime.serve.bench import run_bench

    engine = make_engine(args, max_num_seqs=max([1] + [int(c) for c in args.concurrency.split(",")]),
                         max_batch_tokens=args.max_batch_tokens)
    args.constraint = json_schema_file(args.json_schema) if args.json_schema else None
    result = run_bench(engine, args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def cmd_serve(args) -> int:
    try:
        from runtime.serve.server import load_models, serve
    except ImportError as err:
        raise RuvLLMError(f"serving needs FastAPI, uvicorn and prometheus_client ({err.name} is missing): "
                          "pip install 'ruvllm[serve]'") from err
    if args.max_concurrent < 1:
        raise RuvLLMError("--max-concurrent must be at least 1")
    keys, roots = access_options(args)
    packages = [str(resolve_package(p, isq=args.isq)) for p in (args.packages or [None])]
    defaults = sampling_given(args)
    sampling_from(args)  # the defaults are checked before anything loads
    personalize = personal_settings(args) if args.personalize else None
    if args.ray is not None:
        if personalize is not None:
            raise RuvLLMError("--personalize is not served on Ray yet (users' adapters live beside one engine)")
        return serve_on_ray(args, packages, defaults, keys, roots)
    models = load_models(packages, args.device, args.max_concurrent, engine_options(args), lora_modules(args),
                         threads=args.threads, personalize=personalize, state_dir=args.state_dir)
    print(f"serving {', '.join(models)} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve(models, args.host, args.port, keys, args.max_queue, log_level=args.log_level, defaults=defaults,
          max_request_bytes=args.max_request_bytes, lora_roots=roots)
    return 0


def access_options(args):
    """(ApiKeys, lora roots or None) from --api-key/--api-key-file and --allow-runtime-lora-updating/--lora-root;
    checked before anything loads."""
    from runtime.serve.adapter_roots import AdapterRoots, runtime_updating_allowed
    from runtime.serve.api_keys import ApiKeys

    keys = ApiKeys.load(args.api_key or os.environ.get("RUVLLM_API_KEY"),
                        args.api_key_file or os.environ.get("RUVLLM_API_KEY_FILE"))
    if args.max_request_bytes is not None and args.max_request_bytes < 1024:
        raise RuvLLMError("--max-request-bytes must be at least 1024")
    if not runtime_updating_allowed(args.allow_runtime_lora_updating):
        if args.lora_root:
            raise RuvLLMError("--lora-root is for adapters loaded at run time: add --allow-runtime-lora-updating")
        return keys, None
    AdapterRoots(args.lora_root or [])  # the roots must exist
    return keys, list(args.lora_root)


def serve_on_ray(args, packages: list[str], defaults: dict | None, keys, roots: list[str] | None) -> int:
    """`serve --ray`: the same API with engine replicas on a Ray cluster (docs/SCALING.md)."""
    if len(packages) != 1:
        raise RuvLLMError("--ray serves one package (run one application per package)")
    try:
        from runtime.serve.scaleout.app import ScaleOptions, ServeOptions
        from runtime.serve.scaleout.app import serve_on_ray as run
    except ImportError as err:
        raise RuvLLMError(f"--ray needs Ray Serve ({err.name} is missing): pip install 'ruvllm[ray]'") from err
    try:
        scale = ScaleOptions(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                             target_ongoing_requests=args.target_ongoing_requests, routing=args.routing,
                             replica_cpus=args.replica_cpus, max_ongoing_requests=args.max_concurrent)
        scale.deployment_options()
    except ValueError as err:
        raise RuvLLMError(str(err)) from None
    options = ServeOptions(keys=keys, max_queue=args.max_queue, defaults=defaults, engine_options=engine_options(args),
                           max_request_bytes=args.max_request_bytes, lora_roots=roots)
    print(f"serving {packages[0]} on Ray ({args.replicas} replicas) at http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    from runtime.serve.server import access_warnings

    for line in access_warnings(args.host, keys, roots):
        print(f"warning: {line}", file=sys.stderr)
    run(packages[0], args.ray, args.host, args.port, device=args.device, threads=args.threads,
        adapters=lora_modules(args), scale=scale, options=options)
    return 0


def lora_modules(args) -> dict[str, str]:
    """--lora-modules name=path ... (vLLM's form; a JSON object with name and path works too)."""
    out = {}
    for item in getattr(args, "lora_modules", None) or []:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise RuvLLMError(f"--lora-modules {item!r}: a JSON module needs \"name\" and \"path\"") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise RuvLLMError(f"--lora-modules {item!r}: expected name=path")
        out[name] = path
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ruvllm", description="Run language models on ONNX Runtime")
    ap.add_argument("--version", action="version", version=f"ruvllm {version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def sampling_args(p, max_tokens: int | None = 256) -> None:
        """Every sampling parameter; one not given is the model's (generation_defaults), or for serve the
        request's."""
        p.add_argument("--max-tokens", type=int, default=max_tokens)
        p.add_argument("--temperature", type=float, default=None,
                       help="0: greedy (default: the model's own setting, else 0.8 with top-k 40, top-p 0.95, min-p 0.05)")
        p.add_argument("--top-k", type=int, default=None, help="keep the K likeliest tokens (0 or -1: off)")
        p.add_argument("--top-p", type=float, default=None)
        p.add_argument("--min-p", type=float, default=None)
        p.add_argument("--repetition-penalty", type=float, default=None)
        p.add_argument("--presence-penalty", type=float, default=None)
        p.add_argument("--frequency-penalty", type=float, default=None)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
        p.add_argument("--logprobs", type=int, default=None, help="alternatives per token to report (0-20)")
        p.add_argument("--dry-multiplier", type=float, default=None,
                       help="DRY, llama.cpp's repetition sampler: its strength (0: off, the default; 0.8 is usual)")
        p.add_argument("--dry-base", type=float, default=None, help="DRY: penalty growth per repeated token (1.75)")
        p.add_argument("--dry-allowed-length", type=int, default=None, help="DRY: repeats this long go free (2)")
        p.add_argument("--dry-penalty-last-n", type=int, default=None, help="DRY: tokens looked back (-1: all)")
        p.add_argument("--dry-sequence-breaker", dest="dry_sequence_breakers", action="append", default=None,
                       metavar="TEXT", help="DRY: text that ends a repeat (repeatable; default newline, colon, "
                                            "quote, asterisk)")

    def run_args(p) -> None:
        sampling_args(p)
        p.add_argument("--lora", default=None, help="a LoRA adapter folder (PEFT's, or `python -m exporter adapter`'s)")
        p.add_argument("--json-schema", default=None, metavar="FILE",
                       help="structured output: the reply is JSON valid under this JSON schema file")
        p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "coreml", "auto"])
        p.add_argument("--threads", type=int, default=None)
        engine_args(p)

    def engine_args(p) -> None:
        p.add_argument("--isq", default=None, metavar="QUANT[:METHOD]",
                       help="quantize a model source (Hugging Face folder, .gguf, hub id, alias) as it loads, "
                            "in memory, no package kept: int4, int8 or w8a8, optionally :awq, :gptq, :hqq, :rtn, "
                            ":smoothquant (the exporter's --method)")
        p.add_argument("--kv-memory", default=None, help="KV-cache budget, e.g. 512MB or 1GB (default 512MB)")
        p.add_argument("--num-blocks", type=int, default=None, help="KV-cache size in blocks (overrides --kv-memory)")
        p.add_argument("--block-size", type=int, default=None, help="KV block size in tokens (default: the package's)")
        p.add_argument("--kv-dtype", default=None, choices=list(KV_DTYPES),
                       help="KV-cache numbers: fp32 (default), int8 (about a quarter of the memory; CPU) or int4 "
                            "(about a sixth; CPU with AVX2 or AVX-512)")
        p.add_argument("--speculative-tokens", type=int, default=None,
                       help="prompt-lookup drafts verified per decode step, for requests at temperature <= 0.5 (default 3; 0: off)")
        p.add_argument("--speculative-max-batch", type=int, default=None,
                       help="draft only while at most this many sequences run (default 2)")
        p.add_argument("--batch-invariant", action="store_true",
                       help="a request's tokens never depend on what runs beside it: where this host's kernels do not "
                            "promise it (see GET /v1/models), serve one request at a time, without prefix cache "
                            "or drafts")
        p.add_argument("--no-verify", action="store_true",
                       help="skip checking the package's files against their sha256 (checked once per file change)")
        p.add_argument("--max-loras", type=int, default=None, help="adapters one batch can mix (default 4)")
        p.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank served (default 16)")
        p.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters' weights kept in memory (default: --max-loras)")

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    g.add_argument("package", nargs="?", help="package folder or alias (default: the embedded SmolLM2-135M)")
    g.add_argument("prompt", nargs="?")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message (the default when the model has a chat template)")
    g.add_argument("--raw", action="store_true", help="send the prompt as it is, with no chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    run_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat")
    c.add_argument("package", nargs="?")
    c.add_argument("--system", default=None)
    c.add_argument("--user", default=None, metavar="NAME",
                   help="learn NAME's own adapter from the conversation (their messages, /good, /bad, /prefer)")
    run_args(c)
    personal_args(c, serve=False)
    c.set_defaults(func=cmd_chat)

    ls = sub.add_parser("list", help="packages in the cache")
    ls.add_argument("--long", action="store_true")
    ls.set_defaults(func=cmd_list)

    i = sub.add_parser("info", help="describe a package")
    i.add_argument("package", nargs="?")
    i.add_argument("--json", action="store_true")
    i.add_argument("--device", default="cpu", choices=["cpu", "cuda", "coreml", "auto"])
    i.add_argument("--kv-dtype", default=None, choices=list(KV_DTYPES), help="the KV pool to describe (default fp32)")
    i.add_argument("--state-dir", default=None, metavar="DIR", help="where users' adapters are kept (serve "
                   "--personalize, chat --user; default: the cache's users/)")
    i.set_defaults(func=cmd_info)

    d = sub.add_parser("download", help="export an alias or hub id into the cache")
    d.add_argument("source", help=f"alias ({', '.join(sorted(ALIASES))}) or hub id org/name")
    d.add_argument("--quant", default="int4", choices=["fp32", "fp16", "int8", "int4", "w8a8"])
    d.add_argument("--target", default="cpu", choices=["cpu", "wasm", "webgpu", "cuda"])
    d.add_argument("--method", default=None, choices=["rtn", "awq", "gptq", "awq+gptq", "hqq", "smoothquant"],
                   help="the exporter's --method; with it or --block-size the export is cached in a folder of its own")
    d.add_argument("--block-size", type=int, default=None, help="the exporter's --block-size")
    d.add_argument("--force", action="store_true")
    d.set_defaults(func=cmd_download)

    b = sub.add_parser("bench", help="measure TTFT, prefill and decode speed; prints JSON")
    b.add_argument("package", nargs="?")
    b.add_argument("--json", action="store_true", help="one line of JSON")
    b.add_argument("--decode-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--concurrency", default="1", help="comma-separated stream counts, e.g. 1,4,16,64")
    b.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens of a shared prompt prefix for the concurrent streams; also measures the prefix cache")
    b.add_argument("--context", type=int, default=0,
                   help="each concurrent stream's own prompt of this many tokens (none shared): decode over long "
                        "contexts")
    b.add_argument("--plot", default=None, help="draw throughput and latency against concurrency into this PNG")
    b.add_argument("--max-batch-tokens", type=int, default=512)
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda", "coreml", "auto"])
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--adapters", default=None,
                   help="comma-separated LoRA adapter folders: the concurrent streams also run spread over them")
    b.add_argument("--structured", action="store_true",
                   help="the concurrent streams also run constrained by a JSON schema (a long array of records; "
                        "--json-schema FILE for another), beside free text, with the mask's time per step")
    b.add_argument("--json-schema", default=None, metavar="FILE", help="the schema --structured constrains by")
    engine_args(b)
    b.set_defaults(func=cmd_bench)
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("packages", nargs="*", help="package folders or aliases (default: the embedded model)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8080)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set RUVLLM_API_KEY); "
                    "the key's name is 'default'")
    sv.add_argument("--api-key-file", default=None, metavar="FILE",
                    help="named API keys, each with an optional limit of requests in flight (or set "
                         "RUVLLM_API_KEY_FILE): " + KEY_FILE_HELP)
    sv.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                    help="larger request bodies get a 413 before they are read (default: 1 KiB per token of "
                         "the longest context served, plus 1 MiB)")
    sv.add_argument("--allow-runtime-lora-updating", action="store_true",
                    help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (or set "
                         "RUVLLM_ALLOW_RUNTIME_LORA_UPDATING=1); off by default, as vLLM's")
    sv.add_argument("--lora-root", action="append", default=None, metavar="DIR",
                    help="a folder runtime-loaded adapters may come from (repeatable; needed by "
                         "--allow-runtime-lora-updating)")
    sv.add_argument("--max-concurrent", type=int, default=64, help="sequences generated at once")
    sv.add_argument("--max-queue", type=int, default=None, help="waiting requests before answering 429")
    sv.add_argument("--device", default="cpu", choices=["cpu", "cuda", "coreml", "auto"])
    sv.add_argument("--log-level", default="info")
    sv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="LoRA adapters to serve; a request selects one by its model field")
    sv.add_argument("--threads", type=int, default=None, help="compute threads per engine")
    personal_args(sv, serve=True)
    ray = sv.add_argument_group("scale-out on Ray Serve (pip install 'ruvllm[ray]'; docs/SCALING.md)")
    ray.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                     help="serve engine replicas on a Ray cluster: its address (ray://host:10001 or auto), or none "
                          "to start one on this machine")
    ray.add_argument("--replicas", type=int, default=1, help="engine replicas (the initial count when autoscaling)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscale: fewest replicas")
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscale: most replicas")
    ray.add_argument("--target-ongoing-requests", type=float, default=None,
                     help="autoscale: requests per replica the autoscaler aims at")
    ray.add_argument("--routing", default="prefix", choices=["prefix", "pow2"],
                     help="prefix: to the replica holding the prompt's cached prefix (default); pow2: Ray Serve's "
                          "power of two choices")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per engine replica")
    engine_args(sv)
    sampling_args(sv, None)  # given ones are the defaults of requests that leave the field out
    sv.set_defaults(func=cmd_serve)
    return ap


USAGE = """ruvllm: run language models on your CPU (or GPU), behind a CLI, an OpenAI-compatible server or Python.

  ruvllm generate "Why is the sky blue?"      answer one prompt (the embedded SmolLM2-135M by default)
  ruvllm chat [MODEL]                         talk to a model
  ruvllm serve [MODEL]                        an OpenAI-compatible server on http://127.0.0.1:8080/v1

MODEL: a package folder, an alias (ruvllm download --help lists them), a .gguf file or a Hugging Face id.
ruvllm --help lists every command; ruvllm COMMAND --help its options."""


def version() -> str:
    """The installed distribution's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ruvllm")
    except PackageNotFoundError:
        return "0.1.0+source"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not (sys.argv[1:] if argv is None else argv):
        print(USAGE)
        return 0
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RuvLLMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
