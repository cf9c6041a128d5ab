"""The pure-Python tokenizer against `tokenizers`, id for id, and streaming detokenization."""

from __future__ import annotations

import pytest

from runtime.text.tokenizer import IncrementalDecoder, Tokenizer

TRICKY = [
    "Hello world", "", " ", "   ", "\n", "a \x85b", "\x1c\x1d\x1e\x1f separators", "\x00\x01\x7f control",
    "  multiple   spaces\t\ttabs\n\nnew lines \n ", "trailing space ", " leading", "tab\tsep\r\nwindows\r\n",
    "émoji 👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵", "12345 3.14159 1,000,000 0x1F -42 1e-9", "٣٤٥ ۴۵۶ ½ ² ⅓ Ⅻ",
    "def f(x):\n    return x ** 2  # square\n\tif x != 0: pass", "<div class=\"a\">&amp;</div>",
    "SELECT * FROM t WHERE a='b';", "don't I'll we've THEY'RE she'd you'LL", "'s 's 'S",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>text<|im_end|>end",
    "x<|im_start|>y", "<|im_start|><|im_start|>",
    "日本語のテキスト、中文文本。한국어 텍스트", "Ελληνικά Русский текст עברית العربية हिन्दी ไทย",
    "\u00a0nbsp\u2003emspace\u3000ideographic\u2028line\u2029para", "ZWJ\u200dtest\ufeffbom\u200bzwsp",
    "a" * 80, "ab" * 40 + " " + "xyz" * 30, "Ünïcödé ñ ç ß ø å", "mixed123abc456def", "…—–‘’“”",
    "\U0001f600\U0001f601 \U0001d400\U0001d401", "e\u0301 combining", "😀" * 5,
]


@pytest.fixture(scope="module")
def tokenizers_pair(smol_tokenizer_dir):
    import tokenizers

    path = smol_tokenizer_dir / "tokenizer.json"
    return tokenizers.Tokenizer.from_file(str(path)), Tokenizer.from_file(path, prefer_library=False)


@pytest.mark.parametrize("text", TRICKY)
def test_pure_python_equals_tokenizers(tokenizers_pair, text):
    ref, pure = tokenizers_pair
    assert pure.backend == "pure-python"
    assert pure.encode(text) == ref.encode(text, add_special_tokens=False).ids


def test_pure_python_decode_equals_tokenizers(tokenizers_pair):
    ref, pure = tokenizers_pair
    for text in TRICKY:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert pure.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_incremental_decoding_never_splits_a_character(tokenizers_pair):
    ref, pure = tokenizers_pair
    for text in TRICKY:
        ids = ref.encode(text, add_special_tokens=False).ids
        dec = IncrementalDecoder(pure)
        deltas = [dec.add(i) for i in ids] + [dec.flush()]
        assert "".join(deltas) == pure.decode(ids)
        assert all("\ufffd" not in d for d in deltas) or "\ufffd" in pure.decode(ids)


def test_bos_follows_the_manifest_flag(smol_tokenizer_dir):
    path = smol_tokenizer_dir / "tokenizer.json"
    with_bos = Tokenizer.from_file(path, {"add_bos_token": True, "bos_token_id": 1}, prefer_library=False)
    without = Tokenizer.from_file(path, {"add_bos_token": False, "bos_token_id": 1}, prefer_library=False)
    assert with_bos.encode("hi") == [1] + without.encode("hi")
    assert with_bos.encode("hi", add_bos=False) == without.encode("hi")


def test_unicode_class_tables_stop_early_without_losing_a_character():
    """The \\p{L} / \\p{N} tables scan up to plane 3 only; a full scan of every code point must agree."""
    import sys

    from runtime.text import pretokenize

    full = pretokenize._category_tables.__wrapped__(sys.maxunicode + 1)
    assert pretokenize._category_tables() == full
