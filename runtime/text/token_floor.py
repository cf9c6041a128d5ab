"""The fewest tokens a text can encode to, known from its length alone.

A prompt far past the context must be refused before it is tokenized: tokenizing 20 MB takes
seconds and gigabytes. Every token of a BPE vocabulary stands for a bounded number of the text's
bytes, so a text of B bytes needs at least B / (longest token) tokens, whatever it says. That holds
only for tokenizers that drop no text (or drop known bytes, which are not counted) and whose
normalizer shrinks text by a bounded factor; for any other tokenizer there is no floor (None) and
the caller tokenizes as before.
"""

from __future__ import annotations

from collections.abc import Callable

# How many bytes of a text a normalizer can fold into one byte (NFKC: 4-byte mathematical letters
# into ASCII; NFC: three Hangul jamo into one syllable; Lowercase: the Kelvin sign into "k").
SHRINK = {"NFC": 3, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1}
# Pre-tokenizers that keep every byte of the text (Whitespace and friends drop spaces).
KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts")


class TokenFloor:
    def __init__(self, max_token_bytes: int, shrink: int, dropped: bytes) -> None:
        """max_token_bytes: the most bytes of normalized text one token covers; shrink: the normalizer's
        factor; dropped: bytes the vocabulary encodes as nothing (byte-level vocabularies missing some)."""
        self.per_token = max(1, max_token_bytes) * shrink
        self.dropped = dropped

    def min_tokens(self, text: str) -> int:
        data = text.encode("utf-8")
        counted = len(data.translate(None, self.dropped)) if self.dropped else len(data)
        return -(-counted // self.per_token)

    @classmethod
    def from_spec(cls, spec: dict, token_bytes: Callable[[int], bytes], byte_level: bool) -> TokenFloor | None:
        """The floor of a `tokenizer.json`, or None where its tokens can cover text without bound.

        token_bytes: a byte-level token's bytes. Other vocabularies are measured by their own strings
        (a SentencePiece piece "\u2581\u2581" may stand for two spaces or for those two characters)."""
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            return None
        shrink = _shrink(spec.get("normalizer"))
        if shrink is None or not _keeps_text(spec.get("pre_tokenizer")):
            return None
        added = spec.get("added_tokens") or []
        if any(t.get("lstrip") or t.get("rstrip") for t in added):  # they swallow any run of spaces
            return None
        vocab = model.get("vocab") or {}
        if byte_level:
            longest = max((len(token_bytes(i)) for i in vocab.values()), default=1)
        else:
            longest = max((len(t.encode("utf-8")) for t in vocab), default=1)
        longest = max([longest] + [len(t["content"].encode("utf-8")) for t in added])
        dropped = b""
        if byte_level:
            singles = {token_bytes(i) for i in vocab.values()}
            dropped = bytes(b for b in range(256) if bytes([b]) not in singles)
        elif not model.get("byte_fallback"):
            if model.get("unk_token") is None or model.get("fuse_unk"):
                return None  # unknown characters vanish, or a run of them is one token
            longest = max(longest, 4)  # one unknown character: up to 4 bytes
        return cls(longest, shrink, dropped)


def _shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1
        for step in normalizer.get("normalizers") or []:
            factor = _shrink(step)
            if factor is None:
                return None
            total *= factor
        return total
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content") or ""
        if "String" in pattern and len(content.encode("utf-8")) >= len(pattern["String"].encode("utf-8")) > 0:
            return 1
        return None
    return SHRINK.get(kind)


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers") or [])
    if pre.get("type") == "Split" and pre.get("behavior") == "Removed":
        return False
    return pre.get("type") in KEEPING_PRE_TOKENIZERS
