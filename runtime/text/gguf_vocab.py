"""A GGUF's tokenizer (its `tokenizer.ggml.*` metadata) as the `tokenizer.json` the runtime reads, with the
standard library alone, so the page can open a GGUF without the exporter: what transformers' GGUF
conversion builds (the exporter's path), for the vocabularies the pure-Python BPE runs:

- `gpt2`: byte-level BPE with the file's merges (SmolLM2, Qwen2 and its R1 distills, Llama 3), split by
  the pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`;
- `llama` on a Gemma architecture: SentencePiece BPE with byte fallback; Gemma files carry no merges, so
  they are recovered from the vocabulary, best first in the file's order of tokens (Gemma's scores do not
  follow its merge order), and a token of spaces is spelled in U+2581 as the merges need.

Tokens the file marks as control are special added tokens; those it marks user-defined (`<think>`) are
plain added tokens, matched whole. Anything else is refused by name.
"""

from __future__ import annotations

from runtime.errors import PackageError
from runtime.formats.gguf_file import GGUFHeader
from runtime.text.bpe import BYTE_TO_CHAR

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
SP_SPACE = "\u2581"
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
# How a byte-level vocabulary's text is split before merging, by `tokenizer.ggml.pre` (llama.cpp's names);
# any other name: GPT-2's own split (ByteLevel's regex)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
PRE_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3),
              **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2)}


def _added(tokens: list[str], types: list[int], ids: list[int], special: bool) -> list[dict]:
    return [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": special} for i in ids]


def recovered_merges(tokens: list[str], order: dict[str, float]) -> list[list[str]]:
    """The merges a vocabulary implies: every split of a token into two tokens, best first by `order`
    (higher first), then the longer left piece, then the longer right (transformers' generate_merges)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(set(order.values())) == len(order):  # no two tokens tie (a GGUF's order is the token ids): the sort
        # below keys a split by its token's score, then by its left piece's length, longest first (a token's
        # pieces' lengths add up to its own), so no sort is needed: half the time on Gemma's 262k tokens
        merges = []
        for token in sorted(order, key=order.__getitem__, reverse=True):
            merges.extend([[token[:k], token[k:]] for k in range(len(token) - 1, 0, -1)
                           if token[k:] in vocab and token[:k] in vocab])
        return merges
    merges = []
    for token, score in order.items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[a, b] for a, b, _ in merges]


def _template(spec: dict) -> dict:
    return {"version": "1.0", "truncation": None, "padding": None, **spec,
            "post_processor": {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                               "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                               "special_tokens": {}}}


def tokenizer_json(header: GGUFHeader) -> dict:
    """tokenizer.json of the file's vocabulary. PackageError for a vocabulary the runtime does not build."""
    meta = header.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise PackageError("the GGUF carries no vocabulary (tokenizer.ggml.tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    arch = header.architecture
    if kind == "gpt2":
        alphabet = set(BYTE_TO_CHAR.values())
        spelled = [t if set(t) <= alphabet else "".join(BYTE_TO_CHAR[b] for b in t.encode("utf-8")) for t in tokens]
        merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(merges, list):
            raise PackageError("a byte-level GGUF vocabulary without its merges (tokenizer.ggml.merges)")
        split = PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        pre = byte_level if split is None else {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {**byte_level, "use_regex": False}]}
        # a token marked control but spelled outside the byte alphabet is a mislabel: not added
        control = [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and set(t) <= alphabet]
        user = [i for i, ty in enumerate(types) if ty == USER_DEFINED]
        return _template({
            "added_tokens": sorted(_added(tokens, types, control, True) + _added(tokens, types, user, False),
                                   key=lambda t: t["id"]),
            "normalizer": None, "pre_tokenizer": pre,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {t: i for i, t in enumerate(spelled)},
                      "merges": [m.split(" ", 1) for m in merges]}})
    if kind == "llama" and arch in GEMMA_ARCHS:
        spelled = [SP_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        merges = meta.get("tokenizer.ggml.merges")
        merges = ([m.split(" ", 1) for m in merges] if isinstance(merges, list)
                  else recovered_merges(spelled, {t: -i for i, t in enumerate(spelled)}))
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        control = [i for i, ty in enumerate(types) if ty == CONTROL]
        if isinstance(unk_id, int) and unk_id not in control:
            control = sorted([*control, unk_id])  # GemmaTokenizer's unk token is a special one
        # a user-defined token is added as the file spells it, where that spelling is a token (a run of spaces,
        # stored as spaces, is not: it stays the merges' U+2581 run)
        vocab = set(spelled)
        user = [i for i, ty in enumerate(types) if ty == USER_DEFINED and tokens[i] in vocab]
        return _template({
            "added_tokens": sorted(_added(tokens, types, control, True) + _added(tokens, types, user, False),
                                   key=lambda t: t["id"]),
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SP_SPACE},
            "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                              "invert": False},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": SP_SPACE}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]},
            "model": {"type": "BPE", "dropout": None,
                      "unk_token": spelled[unk_id] if isinstance(unk_id, int) else None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                      "byte_fallback": True, "ignore_merges": False,
                      "vocab": {t: i for i, t in enumerate(spelled)}, "merges": merges}})
    raise PackageError(f"a GGUF vocabulary of kind {kind!r} on {arch!r}: the page builds byte-level (gpt2) ones and "
                       f"Gemma's SentencePiece ones; export it with `python -m exporter convert` instead")


def tokenizer_meta(header: GGUFHeader) -> dict:
    """The manifest's "tokenizer" entry (as exporter/writers/tokenizer_files.py writes it): the special
    tokens and whether plain encoding adds a BOS (the file's flag; a SentencePiece vocabulary without one
    adds it, as llama.cpp does)."""
    meta = header.metadata
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> tuple[str | None, int | None]:
        i = meta.get(f"tokenizer.ggml.{key}")
        return (tokens[i], i) if isinstance(i, int) and 0 <= i < len(tokens) else (None, None)

    bos, bos_id = token("bos_token_id")
    eos, eos_id = token("eos_token_id")
    unk, _ = token("unknown_token_id")
    pad, pad_id = token("padding_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = meta.get("tokenizer.ggml.model") == "llama"
    return {"file": "tokenizer.json", "chat_template": "chat_template.jinja" if meta.get("tokenizer.chat_template") else None,
            "add_bos_token": bool(add_bos) and bos_id is not None,
            "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
            "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
