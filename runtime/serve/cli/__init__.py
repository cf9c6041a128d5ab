"""`ruvllm` (= `python -m runtime`): generate, chat, list, info, download, bench, serve; one module per
command, the flags in parser.py."""

from __future__ import annotations

import os
import sys

from runtime.errors import RuvLLMError
from runtime.serve.cli.parser import build_parser

USAGE = """ruvllm: run language models on your CPU (or GPU), behind a CLI, an OpenAI-compatible server or Python.

  ruvllm generate "Why is the sky blue?"      answer one prompt (the embedded SmolLM2-135M by default)
  ruvllm chat [MODEL]                         talk to a model
  ruvllm serve [MODEL]                        an OpenAI-compatible server on http://127.0.0.1:8080/v1

MODEL: a package folder, an alias (ruvllm download --help lists them), a .gguf file or a Hugging Face id.
ruvllm --help lists every command; ruvllm COMMAND --help its options."""


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
