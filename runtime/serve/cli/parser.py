"""The `ruvllm` command line: every command's flags."""

from __future__ import annotations

import argparse

from runtime.aliases import ALIASES
from runtime.contract import KV_DTYPES
from runtime.core.config import LONG_PREFILL_TOKENS
from runtime.core.request_fields import SAMPLING_FIELDS
from runtime.serve.api_keys import KEY_FILE_HELP
from runtime.serve.cli.chat import cmd_chat
from runtime.serve.cli.generate import cmd_generate
from runtime.serve.cli.models import cmd_download, cmd_info, cmd_list
from runtime.serve.cli.options import personal_args
from runtime.serve.cli.serving import cmd_bench, cmd_serve


def version() -> str:
    """The installed distribution's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ruvllm")
    except PackageNotFoundError:
        return "0.1.0+source"


def build_parser(fields=SAMPLING_FIELDS) -> argparse.ArgumentParser:
    """fields: the declared sampling fields each run command takes as a flag (runtime/core/request_fields.py)."""
    ap = argparse.ArgumentParser(prog="ruvllm", description="Run language models on ONNX Runtime")
    ap.add_argument("--version", action="version", version=f"ruvllm {version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def sampling_args(p, max_tokens: int | None = 256) -> None:
        """Every sampling parameter; one not given is the model's (generation_defaults), or for serve the
        request's."""
        p.add_argument("--max-tokens", type=int, default=max_tokens)
        for f in fields:  # runtime/core/request_fields.py
            p.add_argument(f.flag, type=f.python_type, default=None, help=f.description or None)
        p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
        p.add_argument("--logprobs", type=int, default=None, help="alternatives per token to report (0-20)")
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
        p.add_argument("--long-prefill-tokens", type=int, default=None,
                       help="while some request decodes, a longer prompt computes this many tokens a step (one such "
                            "prompt a step; shorter ones whole), so long prompts do not stall running streams "
                            f"(default {LONG_PREFILL_TOKENS}; 0: the whole step budget)")
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
    sv.add_argument("--no-ollama-api", action="store_true",
                    help="do not serve Ollama's API (/api/chat, /api/generate, /api/tags, ...) beside OpenAI's")
    sv.add_argument("--slot-save-path", default=None, metavar="DIR",
                    help="serve llama.cpp's POST /slots/0?action=save|restore|erase: a conversation's KV blocks "
                         "saved to files in DIR and read back, so its prompt is not prefilled again after a restart")
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
