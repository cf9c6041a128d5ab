"""A GGUF's own sampling settings as generation_config.json fields: runtime/formats/gguf_page.py reads them
(the page's path), and the exporter through it."""

from __future__ import annotations

from runtime.formats.gguf_file import read_header_file
from runtime.formats.gguf_page import generation_fields


def gguf_generation(path: str) -> dict:
    """The generation_config.json fields a GGUF's metadata sets ({} for none)."""
    return generation_fields(read_header_file(path))
