"""The page's Python side of opening a GGUF (web/src/gguf_source.js): its header, read from the page's file
system where the engine worker wrote the file's first bytes, made into a package's small files and the plan
by which the model worker fills step.bin (runtime/formats/gguf_page.py). In two calls: the step's files and
plan first, so step.bin streams in while the second makes the tokenizer (seconds for Gemma 3's vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.errors import RuvLLMError
from runtime.formats.gguf_file import GGUFHeader, NeedBytes, joined_header, read_header
from runtime.formats.gguf_page import step_files, with_tokenizer

_OPENING: dict[str, tuple[GGUFHeader, dict[str, bytes]]] = {}  # by source: the header gguf_tokenizer finishes


def gguf_package(heads: str, source: str, name: str) -> str:
    """`heads`: JSON [{"path", "base"}], where the engine worker wrote each part's first bytes (one for a whole
    file; a split GGUF's parts in order, each with where it begins when they are laid end to end). JSON:
    {"files": {name: text}, "plan": ...} without tokenizer.json (gguf_tokenizer's); {"need": bytes, "part": k}
    when part k's header runs past the bytes given; {"error": why} for a file the page cannot open (refused by
    name, before any weight is read)."""
    parts = []
    for k, part in enumerate(json.loads(heads)):
        try:
            parts.append((read_header(Path(part["path"]).read_bytes()), int(part["base"])))
        except NeedBytes as more:
            return json.dumps({"need": more.total, "part": k})
        except RuvLLMError as err:
            return json.dumps({"error": f"{name}: {err}"})
    try:
        header = joined_header(parts)
    except RuvLLMError as err:
        return json.dumps({"error": f"{name}: {err}"})
    try:
        files, plan = step_files(header, name.removesuffix(".gguf"), source)
    except RuvLLMError as err:
        return json.dumps({"error": str(err)})
    _OPENING.clear()  # one GGUF opens at a time
    _OPENING[source] = (header, files)
    return json.dumps({"files": _texts(files), "plan": plan.to_json()})


def gguf_tokenizer(source: str, folder: str) -> str:
    """Write the package's tokenizer.json into `folder` (the engine's package folder in the page's file system:
    20 MB for Gemma 3, not passed through JavaScript as text); JSON {"manifest": ...} listing it, for the GGUF
    gguf_package opened last, or {"error": why}."""
    if source not in _OPENING:
        return json.dumps({"error": f"{source}: no GGUF header is open (gguf_package first)"})
    header, files = _OPENING.pop(source)
    done = with_tokenizer(files, header)
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "tokenizer.json").write_bytes(done["tokenizer.json"])
    return json.dumps({"manifest": json.loads(done["manifest.json"])})


def _texts(files: dict[str, bytes]) -> dict[str, str]:
    return {n: data.decode() for n, data in files.items()}
