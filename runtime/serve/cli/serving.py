"""`ruvllm serve` (one process, or Ray Serve) and `ruvllm bench`."""

from __future__ import annotations

import json
import sys

from runtime.errors import RuvLLMError
from runtime.resolve import resolve_package
from runtime.serve.cli.options import (
    access_options,
    engine_options,
    json_schema_file,
    lora_modules,
    make_engine,
    personal_settings,
    sampling_from,
    sampling_given,
)


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
        if args.slot_save_path is not None:
            raise RuvLLMError("--slot-save-path is not served on Ray (each replica has a KV pool of its own)")
        return serve_on_ray(args, packages, defaults, keys, roots)
    models = load_models(packages, args.device, args.max_concurrent, engine_options(args), lora_modules(args),
                         threads=args.threads, personalize=personalize, state_dir=args.state_dir)
    print(f"serving {', '.join(models)} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve(models, args.host, args.port, log_level=args.log_level, keys=keys, max_queue=args.max_queue,
          defaults=defaults, max_request_bytes=args.max_request_bytes, lora_roots=roots,
          ollama_api=not args.no_ollama_api, slot_save_path=args.slot_save_path)
    return 0


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
    from runtime.serve.api_keys import access_warnings

    for line in access_warnings(args.host, keys, roots):
        print(f"warning: {line}", file=sys.stderr)
    run(packages[0], args.ray, args.host, args.port, device=args.device, threads=args.threads,
        adapters=lora_modules(args), scale=scale, options=options)
    return 0
