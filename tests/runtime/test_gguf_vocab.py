"""A GGUF's vocabulary as tokenizer.json with the standard library (runtime/text/gguf_vocab.py, issue 75): the
same file transformers' GGUF conversion builds (the exporter's path), and the same ids from the pure-Python
tokenizer as from `tokenizers` on it, for a byte-level vocabulary (the embedded SmolLM2's) and a Gemma one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.errors import PackageError
from runtime.formats.gguf_file import read_header_file
from runtime.text.gguf_vocab import recovered_merges, tokenizer_json, tokenizer_meta
from runtime.text.tokenizer import Tokenizer

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello  world,\n\n  héllo wörld 123456 日本語 😀",
         "   leading spaces and trailing   ", "<start_of_turn>user\nhi<end_of_turn>\n", "don't they'll I'M",
         "<think>why</think> because"]


def write_vocab_gguf(path, arch: str, tokens: list[str], types: list[int], model: str, **ids) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(types)
    for key, value in ids.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("x", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gemma_vocab_gguf(tmp_path_factory):
    """A Gemma 3 file's kind of vocabulary: trained SentencePiece-style BPE pieces in merge order, control
    tokens first, byte pieces, a token of spaces spelled as spaces, a user-defined <think>; no merges."""
    import tokenizers
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, héllo wörld", "they'll don't"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        limit_alphabet=60))
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + ["  ", "<think>"]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2, 3, 3] + [1] * (len(vocab) - 6) + [4, 4] + [6] * 256  # Gemma 3 marks its space runs user-defined
    path = tmp_path_factory.mktemp("vocab") / "gemma-vocab.gguf"
    write_vocab_gguf(path, "gemma3", tokens, types, "llama", bos_token_id=2, eos_token_id=1, unk_token_id=3,
                     pad_token_id=0, add_bos_token=True)
    return path


def _transformers_json(path) -> dict:
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    return json.loads(convert_gguf_tokenizer(arch, tokenizer_dict)[0].to_str())


@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_the_vocabulary_is_transformers_conversion(which, smol_gguf, gemma_vocab_gguf, tmp_path):
    import tokenizers

    path = smol_gguf if which == "smollm2" else gemma_vocab_gguf
    header = read_header_file(path)
    got, want = tokenizer_json(header), _transformers_json(path)
    size = len(got["model"]["vocab"])
    # transformers' GemmaTokenizer adds a "<mask>" past the model's vocabulary; no id the model has
    want["added_tokens"] = [t for t in want["added_tokens"] if t["id"] < size]
    assert got == want
    (tmp_path / "tokenizer.json").write_text(json.dumps(got))
    ref = tokenizers.Tokenizer.from_str(json.dumps(want))
    pure = Tokenizer.from_file(tmp_path / "tokenizer.json", prefer_library=False)
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert pure.encode(text, add_bos=False) == ids, text
        assert pure.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_the_special_tokens_and_bos_rule_are_the_exporters(smol_gguf, gemma_vocab_gguf):
    smol = tokenizer_meta(read_header_file(smol_gguf))
    assert (smol["add_bos_token"], smol["bos_token"], smol["eos_token_id"]) == (False, "<|im_start|>", 2)
    gemma = tokenizer_meta(read_header_file(gemma_vocab_gguf))
    assert (gemma["add_bos_token"], gemma["bos_token"], gemma["eos_token"], gemma["pad_token_id"]) == (True, "<bos>", "<eos>", 0)


def test_recovered_merges_put_the_earlier_token_first():
    """Best first by the token's order; a token's own splits, the longer left piece first."""
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    assert recovered_merges(tokens, {t: -i for i, t in enumerate(tokens)}) == [["a", "b"], ["b", "c"], ["ab", "c"],
                                                                              ["a", "bc"]]


@pytest.mark.parametrize("ties", [False, True])
def test_recovered_merges_equal_transformers(ties):
    """Both paths (scores all distinct, as a GGUF's token order; scores that tie) against transformers'
    generate_merges, on a random vocabulary whose tokens split many ways."""
    import random

    from transformers.convert_slow_tokenizer import generate_merges

    rng = random.Random(7)
    tokens = sorted({"".join(rng.choice("abcd") for _ in range(rng.randint(1, 5))) for _ in range(300)},
                    key=lambda t: (len(t), rng.random()))
    scores = {t: float(-(i // 3) if ties else -i) for i, t in enumerate(tokens)}
    vocab = {t: i for i, t in enumerate(tokens)}
    assert recovered_merges(tokens, scores) == [list(m) for m in generate_merges(vocab, scores)]


def test_a_vocabulary_the_page_cannot_build_is_refused_by_name(tmp_path):
    path = tmp_path / "t5.gguf"
    write_vocab_gguf(path, "t5", ["<pad>", "a"], [3, 1], "t5")
    with pytest.raises(PackageError, match="'t5'"):
        tokenizer_json(read_header_file(path))


def test_the_engine_takes_the_tokenizer_the_page_made_without_parsing_it(tmp_path, smol_gguf, monkeypatch):
    """page_package's tokenizer.json, opened next in the same process (the page's engine worker), is the spec it
    was written from, not the JSON parsed again; the next file of that text is parsed as any other."""
    import runtime.text.tokenizer as tokenizer_module
    from runtime.formats.gguf_page import page_package

    files, _ = page_package(read_header_file(smol_gguf), "m", str(smol_gguf))
    path = tmp_path / "tokenizer.json"
    path.write_bytes(files["tokenizer.json"])
    parsed = []
    real = tokenizer_module.json.loads
    monkeypatch.setattr(tokenizer_module.json, "loads", lambda text: parsed.append(len(text)) or real(text))
    made = Tokenizer.from_file(path, prefer_library=False)
    assert parsed == []
    again = Tokenizer.from_file(path, prefer_library=False)
    assert parsed == [len(files["tokenizer.json"].decode())]
    assert made.encode(TEXTS[1]) == again.encode(TEXTS[1])


def test_the_pages_two_calls_make_the_whole_package(tmp_path, smol_gguf):
    """The page opens a GGUF in two calls (runtime/serve/web_gguf.py): the step's files and plan, then, while
    step.bin streams in, the tokenizer (written into the engine's folder) and the manifest listing it. Together
    they are page_package's files."""
    from runtime.formats.gguf_page import page_package
    from runtime.serve.web_gguf import gguf_package, gguf_tokenizer

    head, data, size = tmp_path / "head", smol_gguf.read_bytes(), 1 << 20
    while True:
        head.write_bytes(data[:size])
        first = json.loads(gguf_package(json.dumps([{"path": str(head), "base": 0}]), "key", "m.gguf"))
        if "need" not in first:
            break
        size = first["need"]
    assert "tokenizer.json" not in first["files"]
    assert "tokenizer.json" not in json.loads(first["files"]["manifest.json"])["files"]
    late = json.loads(gguf_tokenizer("key", str(tmp_path / "pkg")))
    files, plan = page_package(read_header_file(smol_gguf), "m", "key")
    assert (tmp_path / "pkg" / "tokenizer.json").read_bytes() == files["tokenizer.json"]
    assert late["manifest"] == json.loads(files["manifest.json"])
    assert {n: t for n, t in first["files"].items() if n != "manifest.json"} \
        == {n: b.decode() for n, b in files.items() if n not in ("manifest.json", "tokenizer.json")}
    assert first["plan"] == json.loads(json.dumps(plan.to_json()))
    assert "no GGUF header is open" in json.loads(gguf_tokenizer("key", str(tmp_path)))["error"]  # once per header
