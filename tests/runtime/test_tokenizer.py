"""The pure-Python tokenizer against `tokenizers`, id for id, and streaming detokenization."""

from __future__ import annotations

import json

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


@pytest.fixture(scope="module")
def sentencepiece_pair(tmp_path_factory):
    """A SentencePiece-style BPE as Gemma's tokenizer.json has it (spaces to U+2581, one word a text, BPE
    over characters, <0xXX> byte fallback, unk fused), trained here by `tokenizers` on TRICKY's neighbours."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    corpus = [t for t in TRICKY if "😀" not in t and "日本" not in t] * 3 + ["the quick brown fox jumps"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<start_of_turn>", "<end_of_turn>"],
        initial_alphabet=[], limit_alphabet=60))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # the byte-fallback pieces, in the model's vocabulary as Gemma's holds them
        vocab[f"<0x{b:02X}>"] = len(vocab) + 3  # past the three special tokens' ids
    path = tmp_path_factory.mktemp("sp") / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return tokenizers.Tokenizer.from_file(str(path)), Tokenizer.from_file(path, prefer_library=False)


def test_a_sentencepiece_vocabulary_with_byte_fallback_equals_tokenizers(sentencepiece_pair):
    """Gemma's kind of vocabulary in the page (no `tokenizers` there): characters the vocabulary lacks
    become their bytes' tokens, a long text is one word merged in n log n, decoding joins the bytes back."""
    ref, pure = sentencepiece_pair
    assert pure.backend == "pure-python"
    texts = TRICKY + ["<start_of_turn>user\nhi<end_of_turn>\n", "the quick brown fox " * 300]
    for text in texts:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert pure.encode(text) == ids, text
        assert pure.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert any(ref.id_to_token(i).startswith("<0x") for i in ref.encode("日本語 😀", add_special_tokens=False).ids)
