"""A pure-Python byte-level BPE tokenizer that reads `tokenizer.json` and matches `tokenizers` id for id.

Used where the `tokenizers` library cannot be imported (Pyodide). Supports what byte-level BPE
vocabularies (GPT-2, SmolLM, Llama 3, Qwen2, Mistral-Nemo style) use: added tokens, NFC/NFKC
normalizers, ByteLevel / Split / Digits pre-tokenizers, BPE with ignore_merges; and SentencePiece-style
BPE vocabularies (Gemma's): a Replace normalizer (spaces to U+2581), BPE over characters with byte
fallback (<0xXX> tokens for a character the vocabulary lacks), merged as `tokenizers` merges a word
(a heap of pairs by rank, then position), since such a text is one long word.
"""

from __future__ import annotations

import heapq
import re
import unicodedata
from operator import methodcaller

from runtime.errors import PackageError
from runtime.text.pretokenize import GPT2_PATTERN, compile_pattern, split_digits, split_isolated


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


class PureBPE:
    def __init__(self, spec: dict) -> None:
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise PackageError(f"pure-Python tokenizer supports BPE models only, not {model.get('type')}")
        self.byte_fallback = bool(model.get("byte_fallback"))
        # the fallback's pieces are the model's own tokens (an added "<0x41>" is not one, as in `tokenizers`)
        self.byte_ids = [model["vocab"].get(f"<0x{b:02X}>") for b in range(256)] if self.byte_fallback else []
        self.vocab: dict[str, int] = model["vocab"]
        merges = model.get("merges") or []
        # "a b" strings (older files) or ["a", "b"] lists; the first rank of a repeated pair wins. Built
        # by C loops (map, zip, dict): this runs on every page load, in Pyodide.
        pairs = map(methodcaller("split", " ", 1), merges) if merges and isinstance(merges[0], str) else merges
        self.ranks: dict[tuple[str, str], int] = dict(
            zip(reversed(list(map(tuple, pairs))), range(len(merges) - 1, -1, -1)))
        self.ignore_merges = bool(model.get("ignore_merges"))
        self.unk = model.get("unk_token")
        self.fuse_unk = bool(model.get("fuse_unk"))
        self.prefix = model.get("continuing_subword_prefix") or ""
        self.suffix = model.get("end_of_word_suffix") or ""
        if self.prefix or self.suffix:
            raise PackageError("pure-Python tokenizer does not support subword prefixes/suffixes")
        self.added = [t for t in spec.get("added_tokens") or []]
        for t in self.added:
            self.vocab.setdefault(t["content"], t["id"])
        self._added_re = None
        if self.added:
            contents = sorted((t["content"] for t in self.added), key=len, reverse=True)
            self._added_re = re.compile("|".join(re.escape(c) for c in contents))
        self._added_meta = {t["content"]: t for t in self.added}
        self.normalizer = self._normalizer(spec.get("normalizer"))
        self.pre = self._pre_tokenizer(spec.get("pre_tokenizer"))
        self._cache: dict[str, list[int]] = {}

    # ---- configuration ----
    def _normalizer(self, n: dict | None):
        if n is None:
            return lambda s: s
        t = n.get("type")
        if t in ("NFC", "NFKC", "NFD", "NFKD"):
            return lambda s: unicodedata.normalize(t, s)
        if t == "Replace":
            pat, content = n["pattern"], n["content"]
            if "String" in pat:
                return lambda s, a=pat["String"]: s.replace(a, content)
            rx = compile_pattern(pat["Regex"])
            return lambda s: rx.sub(content, s)
        if t == "Sequence":
            fs = [self._normalizer(x) for x in n["normalizers"]]

            def seq(s: str) -> str:
                for f in fs:
                    s = f(s)
                return s
            return seq
        raise PackageError(f"pure-Python tokenizer does not support the {t} normalizer")

    def _pre_tokenizer(self, p: dict | None):
        """Returns a function from a text piece to a list of byte-level-mapped pieces."""
        if p is None:
            return lambda s: [_to_byte_chars(s)]
        steps = p["pretokenizers"] if p.get("type") == "Sequence" else [p]
        funcs = []
        byte_level = False
        for step in steps:
            t = step.get("type")
            if t == "ByteLevel":
                byte_level = True
                if step.get("add_prefix_space"):
                    funcs.append(("prefix", None))
                if step.get("use_regex", True):
                    funcs.append(("split", compile_pattern(GPT2_PATTERN)))
            elif t == "Split":
                pat = step["pattern"]
                if "Regex" in pat:
                    rx = compile_pattern(pat["Regex"])
                else:
                    rx = re.compile(re.escape(pat["String"]))
                behavior = step.get("behavior", "Isolated")
                if behavior not in ("Isolated", "MergedWithPrevious") or step.get("invert"):
                    raise PackageError("pure-Python tokenizer supports Split with Isolated or MergedWithPrevious "
                                       "behaviour only")
                funcs.append(("split" if behavior == "Isolated" else "merged", rx))
            elif t == "Digits":
                funcs.append(("digits", bool(step.get("individual_digits"))))
            else:
                raise PackageError(f"pure-Python tokenizer does not support the {t} pre-tokenizer")
        if not byte_level and not self.byte_fallback:
            raise PackageError("pure-Python tokenizer needs a ByteLevel pre-tokenizer or a byte-fallback vocabulary")
        as_symbols = _to_byte_chars if byte_level else str

        def run(text: str) -> list[str]:
            pieces = [text]
            for kind, arg in funcs:
                nxt: list[str] = []
                for piece in pieces:
                    if kind == "prefix":
                        nxt.append(piece if piece.startswith(" ") else " " + piece)
                    elif kind == "split":
                        nxt.extend(split_isolated(arg, piece))
                    elif kind == "merged":
                        nxt.extend(_split_merged_with_previous(arg, piece))
                    else:
                        nxt.extend(split_digits(piece, arg))
                pieces = nxt
            return [as_symbols(x) for x in pieces]
        return run

    # ---- encoding ----
    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for segment, is_added in self._split_added(text):
            if is_added:
                ids.append(self.vocab[segment])
                continue
            for piece in self.pre(self.normalizer(segment)):
                ids.extend(self._word(piece))
        return ids

    def _split_added(self, text: str):
        if self._added_re is None:
            if text:
                yield text, False
            return
        pos = 0
        spans = []
        for m in self._added_re.finditer(text):
            start, end = m.start(), m.end()
            meta = self._added_meta[m.group()]
            if meta.get("single_word"):
                before = text[start - 1] if start > 0 else " "
                after = text[end] if end < len(text) else " "
                if before.isalnum() or after.isalnum():
                    continue
            if meta.get("lstrip"):
                while start > pos and text[start - 1].isspace():
                    start -= 1
            if meta.get("rstrip"):
                while end < len(text) and text[end].isspace():
                    end += 1
            spans.append((start, end, m.group()))
            pos = end
        pos = 0
        for start, end, content in spans:
            if start > pos:
                yield text[pos:start], False
            yield content, True
            pos = end
        if pos < len(text):
            yield text[pos:], False

    def _word(self, word: str) -> list[int]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        if self.ignore_merges and word in self.vocab:
            out = [self.vocab[word]]
        elif self.byte_fallback:
            out = self._symbol_ids(self._merge_all(word))
        else:
            out = self._bpe(word)
        if len(self._cache) < 100_000:
            self._cache[word] = out
        return out

    def _bpe(self, word: str) -> list[int]:
        parts = list(word)
        ranks = self.ranks
        while len(parts) > 1:
            best, best_i = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            merged = parts[best_i] + parts[best_i + 1]
            # merge every occurrence of this pair, left to right, as tokenizers does for one rank
            a, b = parts[best_i], parts[best_i + 1]
            new: list[str] = []
            i = 0
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                    new.append(merged)
                    i += 2
                else:
                    new.append(parts[i])
                    i += 1
            parts = new
        return self._symbol_ids(parts)

    def _merge_all(self, word: str) -> list[str]:
        """`tokenizers`' merge of one word: the lowest-ranked pair first (the leftmost among equals), each
        merge offering its new neighbours' pairs; linear-logarithmic, for a text that is one word."""
        syms, ranks = list(word), self.ranks
        n = len(syms)
        nxt, prev = list(range(1, n + 1)), list(range(-1, n - 1))
        heap = [(r, i) for i in range(n - 1) if (r := ranks.get((syms[i], syms[i + 1]))) is not None]
        heapq.heapify(heap)
        while heap:
            r, i = heapq.heappop(heap)
            j = nxt[i]
            if syms[i] is None or j >= n or ranks.get((syms[i], syms[j])) != r:
                continue  # merged away, or no longer this pair
            syms[i], syms[j] = syms[i] + syms[j], None
            nxt[i] = nxt[j]
            if nxt[i] < n:
                prev[nxt[i]] = i
                if (r2 := ranks.get((syms[i], syms[nxt[i]]))) is not None:
                    heapq.heappush(heap, (r2, i))
            if prev[i] >= 0 and (r2 := ranks.get((syms[prev[i]], syms[i]))) is not None:
                heapq.heappush(heap, (r2, prev[i]))
        return [s_ for s_ in syms if s_ is not None]

    def _symbol_ids(self, symbols: list[str]) -> list[int]:
        """Each symbol's id; one the vocabulary lacks as its UTF-8 bytes' <0xXX> tokens (byte fallback),
        else the unknown token (fused with one before it when fuse_unk; with no unknown token, tokenizers
        drops the symbol)."""
        ids: list[int] = []
        unk_id = self.vocab.get(self.unk) if self.unk is not None else None
        for sym in symbols:
            tid = self.vocab.get(sym)
            if tid is not None:
                ids.append(tid)
                continue
            fallback = [self.byte_ids[b] for b in sym.encode("utf-8")] if self.byte_fallback else []
            if fallback and None not in fallback:
                ids.extend(fallback)
            elif unk_id is not None and not (self.fuse_unk and ids and ids[-1] == unk_id):
                ids.append(unk_id)
        return ids


def _split_merged_with_previous(rx: re.Pattern, text: str) -> list[str]:
    """Split's MergedWithPrevious: each match ends the piece before it."""
    out, start = [], 0
    for m in rx.finditer(text):
        if m.end() > start:
            out.append(text[start:m.end()])
            start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out


def _to_byte_chars(text: str) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in text.encode("utf-8"))
