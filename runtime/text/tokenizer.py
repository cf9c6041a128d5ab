"""Tokenizer facade: the `tokenizers` library when importable, else the pure-Python BPE.

Encoding never applies tokenizer.json's post-processor; BOS is added by the manifest's
`add_bos_token` flag, so both implementations (and GGUF-sourced packages) agree.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from runtime.errors import PackageError
from runtime.text.bpe import CHAR_TO_BYTE, PureBPE
from runtime.text.token_floor import TokenFloor

# Texts longer than this are encoded through encode_batch, which releases the GIL (encode holds it:
# a long prompt would stall the engine's step thread and every other request).
GIL_FREE_CHARS = 1 << 14


_MADE: dict[str, dict] = {}  # tokenizer.json texts this process wrote, with the spec each was written from


def remember_made(text: str, spec: dict) -> None:
    """`text` was just written from `spec` (the page's package of a GGUF, runtime/formats/gguf_page.py): the
    next from_file of that text takes the spec rather than parse its JSON again (Gemma 3's is 24 MB, 1.7 s
    in Pyodide). Only the latest is kept."""
    _MADE.clear()
    _MADE[text] = spec


def _library_class():
    """The `tokenizers` library's Tokenizer class, or None where it is not installed (Pyodide)."""
    try:
        from tokenizers import Tokenizer as LibTokenizer
    except ImportError:
        return None
    return LibTokenizer


class Tokenizer:
    def __init__(self, spec: dict, meta: dict | None = None, prefer_library: bool = True, library=None) -> None:
        """library: the `tokenizers` Tokenizer of the same spec, when the caller has made it (from_file)."""
        meta = meta or {}
        self.meta = meta
        self._lib = library if prefer_library else None
        if prefer_library and library is None:
            lib_class = _library_class()
            self._lib = lib_class.from_str(json.dumps(spec)) if lib_class is not None else None
        self._pure = None if self._lib is not None else PureBPE(spec)
        self.id_to_token: dict[int, str] = {i: t for t, i in spec["model"]["vocab"].items()}
        self.special_ids: set[int] = set()
        for t in spec.get("added_tokens") or []:
            self.id_to_token[t["id"]] = t["content"]
            if t.get("special"):
                self.special_ids.add(t["id"])
        self.added_ids = {t["id"] for t in spec.get("added_tokens") or []}
        dec = spec.get("decoder") or {}
        steps = dec.get("decoders", []) if dec.get("type") == "Sequence" else [dec]
        self.byte_level = any(s.get("type") == "ByteLevel" for s in steps)
        self.vocab_size = max(self.id_to_token) + 1 if self.id_to_token else 0
        self.bos_token_id = meta.get("bos_token_id")
        self.add_bos = bool(meta.get("add_bos_token"))
        self._bytes_cache: dict[int, bytes] = {}
        # what the token floor is made from, on first use (not the merges: they are the bulk of the file)
        self._spec: dict | None = {**spec, "model": {k: v for k, v in spec["model"].items() if k != "merges"}}
        self._floor: TokenFloor | None = None

    @classmethod
    def from_file(cls, path: str | Path, meta: dict | None = None, prefer_library: bool = True) -> Tokenizer:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise PackageError(f"cannot read tokenizer {path}: {err}") from err
        lib_class = _library_class() if prefer_library else None
        made = _MADE.pop(text, None)
        if made is not None:  # this process wrote the file from this spec a moment ago (remember_made)
            return cls(made, meta, prefer_library, lib_class and lib_class.from_str(text))
        from concurrent.futures import ThreadPoolExecutor

        # the library parses the file without the GIL while json reads it here (no thread where there is no
        # library: Pyodide has no threads)
        with ThreadPoolExecutor(1) as pool:
            library = pool.submit(lib_class.from_str, text) if lib_class is not None else None
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as err:
                raise PackageError(f"cannot read tokenizer {path}: {err}") from err
            library = library and library.result()
        return cls(spec, meta, prefer_library, library)

    @property
    def backend(self) -> str:
        return "tokenizers" if self._lib is not None else "pure-python"

    def min_tokens(self, text: str) -> int | None:
        """The fewest tokens `text` can encode to, from its length alone (None: this vocabulary has no
        such floor). Lets a prompt far past the context be refused before it is tokenized."""
        if self._spec is not None:
            self._floor = TokenFloor.from_spec(self._spec, self.token_bytes, self.byte_level)
            self._spec = None
        return None if self._floor is None else self._floor.min_tokens(text)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        if self._lib is not None and len(text) > GIL_FREE_CHARS:
            ids = self._lib.encode_batch([text], add_special_tokens=False)[0].ids
        elif self._lib is not None:
            ids = self._lib.encode(text, add_special_tokens=False).ids
        else:
            ids = self._pure.encode(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (empty for special tokens), for incremental decoding."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        tok = self.id_to_token.get(token_id, "")
        if token_id in self.added_ids:
            out = b"" if token_id in self.special_ids else tok.encode("utf-8")
        elif self.byte_level:
            out = bytes(CHAR_TO_BYTE[c] for c in tok if c in CHAR_TO_BYTE)
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            out = bytes([int(tok[3:5], 16)])
        else:
            out = tok.replace("\u2581", " ").encode("utf-8")
        self._bytes_cache[token_id] = out
        return out

    def decode_token(self, token_id: int) -> str:
        """One token as text (special tokens by name), for logprobs."""
        if token_id in self.special_ids:
            return self.id_to_token.get(token_id, "")
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._lib is not None:
            return self._lib.decode(list(ids), skip_special_tokens=skip_special_tokens)
        parts = []
        for i in ids:
            if i in self.special_ids and not skip_special_tokens:
                parts.append(self.id_to_token[i].encode("utf-8"))
            else:
                parts.append(self.token_bytes(i))
        return b"".join(parts).decode("utf-8", errors="replace")


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self._utf8.decode(self.tok.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
