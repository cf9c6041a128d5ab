"""Which 4-bit KV scheme (issue 52)? Each candidate's cost in quality, measured, not chosen by name (not a test).

    python benchmarks/kv_schemes.py --package PKG [--tokens 2048] [--text FILE]

The package's decoder runs teacher-forced in numpy (lora_gradients.DenseDecoder: the weights it serves)
over the text, with attention as the two-tier pool computes it: each position reads the keys and values
of its own block and the block before it exact (the tails), every earlier block as the scheme stores it.
Per scheme: the mean KL(fp32 pool || scheme) per token, the perplexity change, top-1 agreement, and the
pool's bytes per token (numbers, scales and zero points; the tails apart, they are the same for all).

Schemes (keys / values): symmetric int4 per group of 32 or 64 numbers of a row with an fp16 scale;
asymmetric (an fp16 minimum too); a Hadamard rotation of each head's row before (QuaRot, "TurboQuant");
KIVI's keys per channel over a block's 16 tokens; int8 per 32 (today's cold tier) as the reference point.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = 16


def hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(math.sqrt(n))


def rows_sym(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """x [..., d] rounded per `group` numbers of a row to signed `bits`-bit steps of one fp16 scale."""
    top = 2 ** (bits - 1) - 1
    g = x.reshape(*x.shape[:-1], -1, group)
    s = (np.abs(g).max(-1, keepdims=True) / top).astype(np.float16).astype(np.float32)
    q = np.clip(np.round(g / np.where(s > 0, s, 1)), -top, top)
    return (q * s).reshape(x.shape)


def rows_asym(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Per group: an fp16 minimum and scale, unsigned `bits`-bit steps."""
    top = 2 ** bits - 1
    g = x.reshape(*x.shape[:-1], -1, group)
    lo = g.min(-1, keepdims=True).astype(np.float16).astype(np.float32)
    s = ((g.max(-1, keepdims=True) - lo) / top).astype(np.float16).astype(np.float32)
    q = np.clip(np.round((g - lo) / np.where(s > 0, s, 1)), 0, top)
    return (q * s + lo).reshape(x.shape)


def channels_asym(x: np.ndarray, bits: int) -> np.ndarray:
    """KIVI's keys: per channel over each block of BLOCK tokens (x [T, heads, d])."""
    T = x.shape[0]
    pad = -T % BLOCK
    xp = np.concatenate([x, np.repeat(x[-1:], pad, 0)]) if pad else x
    g = xp.reshape(-1, BLOCK, *x.shape[1:])
    top = 2 ** bits - 1
    lo = g.min(1, keepdims=True).astype(np.float16).astype(np.float32)
    s = ((g.max(1, keepdims=True) - lo) / top).astype(np.float16).astype(np.float32)
    q = np.clip(np.round((g - lo) / np.where(s > 0, s, 1)), 0, top)
    return (q * s + lo).reshape(xp.shape)[:T]


def rotated(fn, size: int = 0):
    """fn on the rows rotated by a Hadamard matrix of the row's width (or of `size` numbers at a time: a
    block-diagonal one, which a kernel can undo 16 numbers, one vector, at a time), rotated back."""
    def apply(x: np.ndarray) -> np.ndarray:
        n = size or x.shape[-1]
        h = hadamard(n)
        blocks = lambda y, m: (y.reshape(*y.shape[:-1], -1, n) @ m).reshape(y.shape)  # noqa: E731
        return blocks(fn(blocks(x, h)), h.T)  # H is orthonormal: the scores and the weighted sum see x itself, rounded
    return apply


def across(fn):
    """fn on the rows rotated by H4 across their four quarters (numbers i, i + d/4, i + d/2, i + 3d/4 mixed:
    whole vectors added and subtracted, no shuffles within one), rotated back."""
    def apply(x: np.ndarray) -> np.ndarray:
        h = hadamard(4)
        q = x.reshape(*x.shape[:-1], 4, -1)
        mix = lambda y, m: np.einsum("ij,...jk->...ik", m, y)  # noqa: E731
        return mix(fn(mix(q, h).reshape(x.shape)).reshape(q.shape), h.T).reshape(x.shape)
    return apply


# name -> (keys' rounding, values' rounding, bytes a row of d numbers costs: d -> bytes)
SCHEMES = {
    "int8 g32 (today)": (lambda x: rows_sym(x, 8, 32), lambda x: rows_sym(x, 8, 32), lambda d: d + 2 * d / 32),
    "int4 g32 sym": (lambda x: rows_sym(x, 4, 32), lambda x: rows_sym(x, 4, 32), lambda d: d / 2 + 2 * d / 32),
    "int4 g64 sym": (lambda x: rows_sym(x, 4, 64), lambda x: rows_sym(x, 4, 64), lambda d: d / 2 + 2 * d / 64),
    "int4 g32 asym": (lambda x: rows_asym(x, 4, 32), lambda x: rows_asym(x, 4, 32), lambda d: d / 2 + 4 * d / 32),
    "int4 g64 asym": (lambda x: rows_asym(x, 4, 64), lambda x: rows_asym(x, 4, 64), lambda d: d / 2 + 4 * d / 64),
    "hadamard int4 g32 sym": (rotated(lambda x: rows_sym(x, 4, 32)), rotated(lambda x: rows_sym(x, 4, 32)),
                              lambda d: d / 2 + 2 * d / 32),
    "hadamard int4 g64 sym": (rotated(lambda x: rows_sym(x, 4, 64)), rotated(lambda x: rows_sym(x, 4, 64)),
                              lambda d: d / 2 + 2 * d / 64),
    "hadamard int4 g64 asym": (rotated(lambda x: rows_asym(x, 4, 64)), rotated(lambda x: rows_asym(x, 4, 64)),
                               lambda d: d / 2 + 4 * d / 64),
    "hadamard int4 g32 asym": (rotated(lambda x: rows_asym(x, 4, 32)), rotated(lambda x: rows_asym(x, 4, 32)),
                               lambda d: d / 2 + 4 * d / 32),
    "hadamard keys g32 asym, values g64 asym": (rotated(lambda x: rows_asym(x, 4, 32)), rotated(lambda x: rows_asym(x, 4, 64)),
                                                lambda d: d / 2 + 4 * d / 32 / 2 + 4 * d / 64 / 2),
    "hadamard16 keys g32 asym, values g64 asym": (rotated(lambda x: rows_asym(x, 4, 32), 16),
                                                  rotated(lambda x: rows_asym(x, 4, 64), 16),
                                                  lambda d: d / 2 + 4 * d / 32 / 2 + 4 * d / 64 / 2),
    "hadamard keys g32 asym, values g64 asym unrotated": (rotated(lambda x: rows_asym(x, 4, 32)), lambda x: rows_asym(x, 4, 64),
                                                          lambda d: d / 2 + 4 * d / 32 / 2 + 4 * d / 64 / 2),
    "hadamard keys g32 asym, values g32 asym unrotated": (rotated(lambda x: rows_asym(x, 4, 32)), lambda x: rows_asym(x, 4, 32),
                                                          lambda d: d / 2 + 4 * d / 32),
    "hadamard keys g32 asym, values g64 asym rotated across quarters": (
        rotated(lambda x: rows_asym(x, 4, 32)), across(lambda x: rows_asym(x, 4, 64)),
        lambda d: d / 2 + 4 * d / 32 / 2 + 4 * d / 64 / 2),
    "hadamard keys g64 asym, values g32 asym": (rotated(lambda x: rows_asym(x, 4, 64)), rotated(lambda x: rows_asym(x, 4, 32)),
                                                lambda d: d / 2 + 4 * d / 64 / 2 + 4 * d / 32 / 2),
    "hadamard kivi (keys per channel over a block; values g32 asym)": (
        rotated(lambda x: channels_asym(x, 4)), rotated(lambda x: rows_asym(x, 4, 32)),
        lambda d: d / 2 + 4 * d / BLOCK / 2 + 4 * d / 32 / 2),
    "kivi (keys per channel over a block; values g32 asym)": (lambda x: channels_asym(x, 4), lambda x: rows_asym(x, 4, 32),
                                                lambda d: d / 2 + 4 * d / BLOCK / 2 + 4 * d / 32 / 2),
}


def forward(dec, ids: list[int], kv_round=None, tail_blocks: int = 2, tail=None, sink: int = 0) -> np.ndarray:
    """log-softmax of the next-token logits at every position; kv_round: (keys', values' rounding) of the
    blocks older than the tail (a position's own block and tail_blocks - 1 before it), or None (fp32);
    tail: the tail's rounding (None: exact); sink: the text's first `sink` positions read exact by every
    query too (an attention sink kept at full precision, as IntactKV / KVQuant keep theirs)."""
    from runtime.backends.lora_gradients import _rms, _rotate

    T = len(ids)
    hq, hkv, d, F = dec.num_heads, dec.num_kv_heads, dec.head_dim, dec.intermediate
    group, scale = hq // hkv, np.float32(1.0 / np.sqrt(d))
    cos, sin = dec.cos[:T], dec.sin[:T]
    x = dec.embed_rows(ids)
    for L in dec.layers:
        a, _ = _rms(x, L["input_norm"], dec.eps)
        qkv = a @ L["qkv_t"]
        if "qkv_bias" in L:
            qkv = qkv + L["qkv_bias"]
        q, k, v = np.split(qkv, [hq * d, (hq + hkv) * d], axis=1)
        q = _rotate(q.reshape(T, hq, d), cos, sin)
        k = _rotate(k.reshape(T, hkv, d), cos, sin)
        v = v.reshape(T, hkv, d)
        kq, vq = (kv_round[0](k), kv_round[1](v)) if kv_round else (k, v)
        if kv_round and sink:
            kq, vq = np.concatenate([k[:sink], kq[sink:]]), np.concatenate([v[:sink], vq[sink:]])
        if kv_round and tail:
            k, v = tail(k), tail(v)
        qh = q.transpose(1, 0, 2)  # [hq, T, d]
        out = np.empty((hq, T, d), np.float32)
        for b0 in range(0, T, BLOCK):
            b1 = min(b0 + BLOCK, T)
            exact = max(b0 - (tail_blocks - 1) * BLOCK, 0)  # the tail: this block and those before it, exact
            keys = np.concatenate([kq[:exact], k[exact:b1]])
            vals = np.concatenate([vq[:exact], v[exact:b1]])
            kh = np.repeat(keys, group, axis=1).transpose(1, 2, 0)  # [hq, d, n]
            vh = np.repeat(vals, group, axis=1).transpose(1, 0, 2)  # [hq, n, d]
            s = qh[:, b0:b1] @ kh * scale
            causal = np.arange(b1)[None, :] > np.arange(b0, b1)[:, None]
            s = np.where(causal[None], -np.inf, s)
            s -= s.max(-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(-1, keepdims=True)
            out[:, b0:b1] = p @ vh
        o = out.transpose(1, 0, 2).reshape(T, hq * d)
        x1 = x + o @ L["o_t"]
        m, _ = _rms(x1, L["post_norm"], dec.eps)
        gu = m @ L["gate_up_t"]
        gate, up = gu[:, :F], gu[:, F:]
        x = x1 + (gate / (1 + np.exp(-gate)) * up) @ L["down_t"]
    z, _ = _rms(x, dec.final_norm, dec.eps)
    logits = (z @ dec.head_t).astype(np.float64)
    logits -= logits.max(1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--schemes", default="|".join(SCHEMES), help="names separated by |")
    ap.add_argument("--tail-blocks", type=int, default=2, help="blocks read exact: a position's own and those before")
    ap.add_argument("--tail-dtype", choices=("fp32", "fp16", "int8"), default="fp32", help="the tail's numbers")
    ap.add_argument("--sink", type=int, default=0, help="the text's first positions, read exact by every query")
    args = ap.parse_args()
    from exporter.evaluate import quality
    from runtime.backends.lora_gradients import DenseDecoder
    from runtime.package import load_package
    from runtime.text.prompt import package_tokenizer

    pkg = load_package(args.package)
    dec = DenseDecoder.from_package(pkg)
    ids = package_tokenizer(pkg).encode(Path(args.text).read_text())[:args.tokens]
    started = time.perf_counter()
    ref = forward(dec, ids)
    rows = []
    d = dec.head_dim
    for name in args.schemes.split("|"):
        keys, values, row_bytes = SCHEMES[name]
        tail = {"fp32": None, "fp16": lambda x: x.astype(np.float16).astype(np.float32),
                "int8": lambda x: rows_sym(x, 8, 32)}[args.tail_dtype]
        got = quality(ref, forward(dec, ids, (keys, values), args.tail_blocks, tail, args.sink), ids)
        row = {"scheme": name, "kl": round(float(got["kl"]), 6), "ppl_change": round(got["ppl"] / got["ppl_ref"] - 1, 5),
               "top1": round(float(got["top1"]), 4), "bytes_per_number": row_bytes(d) / d,
               "vs_fp32": round(4 * d / row_bytes(d), 2)}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "package": str(pkg.path), "text": args.text,
                      "tokens": len(ids), "tail_blocks": args.tail_blocks, "tail_dtype": args.tail_dtype, "sink": args.sink, "ppl_fp32_pool": round(float(np.exp(-np.mean(
                          [ref[i, ids[i + 1]] for i in range(len(ids) - 1)]))), 4),
                      "seconds": round(time.perf_counter() - started, 1), "schemes": rows}, indent=1))


if __name__ == "__main__":
    main()
