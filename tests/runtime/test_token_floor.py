"""The token floor: never more than the real token count, and a prompt past it is refused untokenized."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.errors import ContextLengthError
from runtime.text.prompt import PromptEncoder
from runtime.text.token_floor import TokenFloor
from runtime.text.tokenizer import Tokenizer

# pieces that stress the floor: the vocabulary's longest tokens (runs of '#', '=', newline + spaces), bytes
# SmolLM2's vocabulary drops (\x04, \x06), special-token text, combining marks, CJK, emoji, 4-byte letters
PIECES = ["#" * 80, "=" * 65, "\n" + " " * 80, " ", "\x04", "\x06\x13", "<|im_start|>", "<|im_end|>", "e\u0301",
          "\u4e2d\u6587", "\U0001f600", "\U0001d400", "\U00040000", "hello", " world", "\u2581\u2581", "\r\n", "123456"]
TEXTS = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=12)), max_size=40).map("".join)


@pytest.fixture(scope="module")
def smol_spec(smol_tokenizer_dir) -> dict:
    return json.loads((smol_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module", params=["tokenizers", "pure-python"])
def smol(request, smol_spec) -> Tokenizer:
    return Tokenizer(json.loads(json.dumps(smol_spec)), prefer_library=request.param == "tokenizers")


def test_smollm2_floor_is_its_longest_token_and_dropped_bytes(smol):
    assert smol.min_tokens("") == 0
    assert smol.min_tokens("#" * 80) == 1 and smol.min_tokens("#" * 82) == 2
    assert smol.min_tokens("\x04" * 1000) == 0  # bytes the vocabulary lacks encode to nothing
    assert smol.encode("\x04" * 1000) == []


@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_floor_never_exceeds_the_token_count_smollm2(smol, text):
    assert smol.min_tokens(text) <= len(smol.encode(text, add_bos=False))


@pytest.fixture(scope="module")
def sentencepiece_spec() -> dict:
    """A SentencePiece-style BPE (Metaspace, byte fallback), trained here as Llama 2's and Mistral's are built."""
    from tokenizers import SentencePieceBPETokenizer

    tok = SentencePieceBPETokenizer()
    corpus = ["the sea is wide and deep", "waves on the shore, again and again", "\u2581\u2581 odd marks",
              "numbers 12345 and more", "    indented    text"] * 20
    tok.train_from_iterator(corpus, vocab_size=300, min_frequency=1, show_progress=False)
    spec = json.loads(tok.to_str())
    spec["model"]["byte_fallback"] = True
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte fallback needs every <0xNN> piece
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return spec


@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_floor_never_exceeds_the_token_count_sentencepiece(sentencepiece_spec, text):
    tok = Tokenizer(sentencepiece_spec)
    floor = tok.min_tokens(text)
    assert floor is not None and floor <= len(tok.encode(text))


@pytest.mark.parametrize("change", [
    {"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},  # drops any run of spaces
    {"normalizer": {"type": "StripAccents"}},
    {"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}},
    {"pre_tokenizer": {"type": "Whitespace"}},
    {"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False}},
])
def test_tokenizers_that_can_drop_text_have_no_floor(smol_spec, change):
    spec = {**smol_spec, **change}
    assert TokenFloor.from_spec(spec, lambda i: b"x", byte_level=True) is None


def test_added_tokens_that_swallow_spaces_have_no_floor(smol_spec):
    spec = json.loads(json.dumps(smol_spec))
    spec["added_tokens"][0]["lstrip"] = True
    assert Tokenizer(spec).min_tokens("a" * 100) is None


def test_a_prompt_past_the_floor_is_refused_before_it_is_tokenized(smol_spec):
    tok = Tokenizer(smol_spec)
    calls = []
    real = tok.encode
    tok.encode = lambda text, add_bos=None: calls.append(len(text)) or real(text, add_bos)
    prompts = PromptEncoder(tok, None, tok.vocab_size, max_context=256)
    with pytest.raises(ContextLengthError, match="at least 1235 tokens; this model's context is 256"):
        prompts.encode("#" * 100_000)
    with pytest.raises(ContextLengthError, match="has 256 tokens"):
        prompts.encode([5] * 256)  # ids: counted, not checked one by one
    assert calls == []
    assert prompts.encode("hello " * 10) == real("hello " * 10) and calls == [60]
