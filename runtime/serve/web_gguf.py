"""The page's Python side of opening a GGUF (web/src/gguf_source.js): its header, read from the page's file
system where the engine worker wrote the file's first bytes, made into a package's small files and the plan
by which the model worker fills step.bin (runtime/formats/gguf_page.py)."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.errors import RuvLLMError
from runtime.formats.gguf_file import NeedBytes, read_header
from runtime.formats.gguf_page import page_package


def gguf_package(head_path: str, source: str, name: str) -> str:
    """JSON: {"files": {name: text}, "plan": ...}; {"need": bytes} when the header runs past the bytes at
    `head_path`; {"error": why} for a file the page cannot open (refused by name, before any weight is read)."""
    try:
        header = read_header(Path(head_path).read_bytes())
    except NeedBytes as more:
        return json.dumps({"need": more.total})
    except RuvLLMError as err:
        return json.dumps({"error": f"{name}: {err}"})
    try:
        files, plan = page_package(header, name.removesuffix(".gguf"), source)
    except RuvLLMError as err:
        return json.dumps({"error": str(err)})
    return json.dumps({"files": {n: data.decode() for n, data in files.items()}, "plan": plan.to_json()})
