"""The package's tokenizer files, and what the runtime must know to encode as the source does."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from exporter.sources.locate import gguf_add_bos
from runtime.errors import RuvLLMError


def write_tokenizer(tok, out: Path, source) -> dict:
    with tempfile.TemporaryDirectory() as td:
        tok.save_pretrained(td)
        src = Path(td) / "tokenizer.json"
        if not src.exists():
            raise RuvLLMError(f"{source.id}: the tokenizer has no tokenizer.json (only fast tokenizers are supported)")
        shutil.copy(src, out / "tokenizer.json")
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str) and template:
        (out / "chat_template.jinja").write_text(template)
    # Does plain encoding add a BOS? A GGUF's own flag wins over transformers' conversion (DESIGN §7).
    plain = tok("a", add_special_tokens=False).input_ids
    with_special = tok("a").input_ids
    add_bos = tok.bos_token_id is not None and len(with_special) > len(plain) and with_special[0] == tok.bos_token_id
    if source.kind == "gguf":
        flag = gguf_add_bos(source.path)
        if flag is not None:
            add_bos = flag
    return {
        "file": "tokenizer.json",
        "chat_template": "chat_template.jinja" if (out / "chat_template.jinja").exists() else None,
        "add_bos_token": bool(add_bos),
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "unk_token": tok.unk_token,
        "pad_token": tok.pad_token,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
    }
