"""What the CLI's commands share: engine and sampling options from their flags, adapters, access."""

from __future__ import annotations

import json
import os
from pathlib import Path

from runtime.core.request_fields import SAMPLING_FIELDS
from runtime.core.sampling import SamplingParams
from runtime.errors import RuvLLMError
from runtime.resolve import resolve_package

# the flags that are sampling settings: the declared fields (runtime/core/request_fields.py) and the others
SAMPLING_FLAGS = ("max_tokens", *(f.name for f in SAMPLING_FIELDS), "stop", "logprobs", "dry_sequence_breakers")


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
    for name in ("speculative_tokens", "speculative_max_batch", "max_loras", "max_lora_rank", "max_cpu_loras",
                 "long_prefill_tokens"):
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


def add_lora(engine, args) -> str | None:
    """--lora PATH: the adapter every request of generate / chat runs on."""
    if not getattr(args, "lora", None):
        return None
    return engine.adapters.add("lora", args.lora).name


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
