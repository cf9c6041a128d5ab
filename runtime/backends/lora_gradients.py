"""Gradients of a LoRA's factors, computed by hand: the instant loop of per-user adaptation (issue 51).

onnxruntime's inference builds have no backward, and the runtime has no torch, so the decoder is run
here once more in numpy, teacher-forced over a text, keeping what the backward needs, and the loss is
carried back to every adapted projection's A and B (the base weights stay frozen). The numbers are
checked against PEFT's autograd (tests/runtime/test_lora_gradients.py).

Why every layer rather than the cheap last one: on SmolLM2 with eight package READMEs as "users",
rank 4 on the last layer's down projection alone lowered the held-out perplexity by 3.2 % on average
(two users got worse at a higher rate), rank 4 on every layer's q and v by 6.3 % (docs/PERFORMANCE.md).

The weights are the package's own, as the served graph holds them (fp32, a MatMulNBits grid, a GGUF's
blocks: dense_weights.py), so a quantized package learns against the model it serves (as QLoRA does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.backends.dense_weights import GraphWeights
from runtime.errors import PackageError

ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class Lora:
    """A LoRA's factors per (layer, target): A [rank, in], B [out, rank], PEFT's layout; delta = scale x A^T B^T."""

    factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    scale: float

    def zeros_like(self) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
        return {k: (np.zeros_like(a), np.zeros_like(b)) for k, (a, b) in self.factors.items()}


class DenseCache:
    """Dense matrices kept between steps, up to a byte budget; the first that fit stay (a step reads the
    layers forward then backward, so evicting the least recently used would keep none of them)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget, self.used, self.kept = budget_bytes, 0, {}

    def get(self, key, make):
        got = self.kept.get(key)
        if got is None:
            got = make()
            size = sum(a.nbytes for a in got.values()) if isinstance(got, dict) else got.nbytes
            if self.used + size <= self.budget:
                self.kept[key] = got
                self.used += size
        return got


def default_budget() -> int:
    """RUVLLM_TRAIN_DENSE_MB (default 1,024): fp32 weights the trainer keeps between steps."""
    import os

    return int(float(os.environ.get("RUVLLM_TRAIN_DENSE_MB", "1024")) * 2 ** 20)


class _Layers:
    """The decoder's layers as the backward reads them, each dense on demand (DenseCache)."""

    def __init__(self, dec: DenseDecoder, count: int) -> None:
        self.dec, self.count = dec, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        return self.dec.cache.get(("layer", i), lambda: self.dec._layer(i))

    def __iter__(self):
        return (self[i] for i in range(self.count))


@dataclass
class DenseDecoder:
    """A package's decoder as the backward reads it: its norms and rotary tables, and each layer's
    projections as dense fp32 [in, out] (dense_weights.GraphWeights: fp32, MatMulNBits grids and GGUF
    blocks alike), made per layer when needed and kept while the budget lasts."""

    weights: GraphWeights
    cache: DenseCache
    num_layers: int
    final_norm: np.ndarray
    cos: np.ndarray  # [positions, head_dim // 2]
    sin: np.ndarray
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    features: dict[str, tuple[int, int]] = field(default_factory=dict)  # target -> (in, out)

    @classmethod
    def from_package(cls, pkg, budget_bytes: int | None = None) -> DenseDecoder:
        m, cfg = pkg.manifest, pkg.config
        if m["architecture"] not in ARCHITECTURES:
            raise PackageError(f"{pkg.path}: adapting a {m['architecture']} model's LoRA is not supported here yet "
                               f"(only {', '.join(ARCHITECTURES)})")
        w = GraphWeights(pkg.file(m["graphs"]["decoder"]["file"]))
        hq, hkv, d, f = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["intermediate_size"]
        h = cfg["hidden_size"]
        features = {"q_proj": (h, hq * d), "k_proj": (h, hkv * d), "v_proj": (h, hkv * d), "o_proj": (hq * d, h),
                    "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
        cache = DenseCache(default_budget() if budget_bytes is None else budget_bytes)
        return cls(w, cache, cfg["num_layers"], w.array("model.norm"), w.array("rope.cos"), w.array("rope.sin"),
                   hq, hkv, d, f, cfg["rms_norm_eps"], features)

    @property
    def layers(self) -> _Layers:
        return _Layers(self, self.num_layers)

    def _layer(self, i: int) -> dict[str, np.ndarray]:
        w, p = self.weights, f"layers.{i}."
        layer = {"input_norm": w.array(p + "input_layernorm"), "post_norm": w.array(p + "post_attention_layernorm"),
                 "qkv_t": w.matrix(p + "qkv_proj"), "o_t": w.matrix(p + "o_proj"),
                 "gate_up_t": w.matrix(p + "gate_up_proj"), "down_t": w.matrix(p + "down_proj")}
        if p + "qkv_bias" in w.inits:
            layer["qkv_bias"] = w.array(p + "qkv_bias")
        return layer

    def embed_rows(self, ids: list[int]) -> np.ndarray:
        return self.weights.embedding_rows(np.asarray(ids))

    @property
    def head_t(self) -> np.ndarray:
        """The output projection [hidden, vocab]: lm_head, or the embedding table when they are tied."""
        def make():
            if "lm_head" in self.weights:
                return self.weights.matrix("lm_head")
            vocab = self.weights.embedding_vocab()
            return np.ascontiguousarray(self.embed_rows(list(range(vocab))).T)
        return self.cache.get("head", make)


def _rms(x: np.ndarray, g: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    r = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x / r * g, r


def _rms_back(dy: np.ndarray, x: np.ndarray, r: np.ndarray, g: np.ndarray) -> np.ndarray:
    u = dy * g
    return u / r - x * (np.sum(u * x, axis=-1, keepdims=True) / (x.shape[-1] * r ** 3))


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """HF's rotate_half RoPE on [T, heads, d] with cos/sin [T, d/2]."""
    h = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _rotate_back(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    h = dy.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    d1, d2 = dy[..., :h], dy[..., h:]
    return np.concatenate([d1 * c + d2 * s, d2 * c - d1 * s], axis=-1)


def _add_lora(x: np.ndarray, y: np.ndarray, lora: Lora, key: tuple[int, str], cache: list) -> np.ndarray:
    """y (x's projection by the base weight) plus the target's LoRA delta, in place; the backward's inputs
    (x and x A^T) kept in `cache`."""
    f = lora.factors.get(key)
    if f is not None:
        t = x @ f[0].T
        y += lora.scale * (t @ f[1].T)
        cache.append((key, x, t))
    return y


def lowest_layer(lora: Lora, layers: int) -> int:
    """The first layer the LoRA adapts (`layers` when none): the backward stops there, since nothing below
    it has a factor to learn."""
    return min((i for i, _ in lora.factors), default=layers)


def _forward(dec: DenseDecoder, ids: list[int], lora: Lora, keep: bool):
    """The LoRA model's forward over one sequence: (the last layer's output, the final norm's output and
    root mean squares, the logits [T, vocab], what the backward reads per layer (kept when `keep`, from the
    lowest adapted layer on; None below it))."""
    T = len(ids)
    if T < 2:
        raise ValueError("a text of at least two tokens")
    if T > dec.cos.shape[0]:
        raise ValueError(f"{T} tokens is past the model's {dec.cos.shape[0]} positions")
    hq, hkv, d, F = dec.num_heads, dec.num_kv_heads, dec.head_dim, dec.intermediate
    group, scale = hq // hkv, np.float32(1.0 / np.sqrt(d))  # an np.float64 would make the stream float64
    cos, sin = dec.cos[:T], dec.sin[:T]
    causal = np.triu(np.full((T, T), -np.inf, np.float32), 1)
    x = dec.embed_rows(ids)
    saved = []
    lowest = lowest_layer(lora, len(dec.layers))
    for i, L in enumerate(dec.layers):
        lora_cache: list = []
        a, r1 = _rms(x, L["input_norm"], dec.eps)
        qkv = a @ L["qkv_t"]
        if "qkv_bias" in L:
            qkv = qkv + L["qkv_bias"]
        q, k, v = np.split(qkv, [hq * d, (hq + hkv) * d], axis=1)
        for t, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            _add_lora(a, part, lora, (i, t), lora_cache)
        qr = _rotate(q.reshape(T, hq, d), cos, sin)
        kr = _rotate(k.reshape(T, hkv, d), cos, sin)
        vv = v.reshape(T, hkv, d)
        qh = np.ascontiguousarray(qr.transpose(1, 0, 2))  # [hq, T, d]: batched matmuls, not einsum's loops
        kh = np.ascontiguousarray(np.repeat(kr, group, axis=1).transpose(1, 0, 2))
        vh = np.ascontiguousarray(np.repeat(vv, group, axis=1).transpose(1, 0, 2))
        s = qh @ kh.transpose(0, 2, 1) * scale + causal  # [hq, T, T]
        s -= s.max(-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(-1, keepdims=True)
        o = (p @ vh).transpose(1, 0, 2).reshape(T, hq * d)
        x1 = x + _add_lora(o, o @ L["o_t"], lora, (i, "o_proj"), lora_cache)
        m, r2 = _rms(x1, L["post_norm"], dec.eps)
        gu = m @ L["gate_up_t"]
        gate, up = gu[:, :F], gu[:, F:]
        for t, part in (("gate_proj", gate), ("up_proj", up)):
            _add_lora(m, part, lora, (i, t), lora_cache)
        sig = 1.0 / (1.0 + np.exp(-gate))
        act = gate * sig * up
        x2 = x1 + _add_lora(act, act @ L["down_t"], lora, (i, "down_proj"), lora_cache)
        if keep:  # what the backward reads (a scoring pass keeps nothing: 2,048 tokens' scores are GBs)
            saved.append(None if i < lowest else (x, a, r1, qh, kh, vh, p, o, x1, m, r2, gate, up, sig, act, lora_cache))
        x = x2
    z, rf = _rms(x, dec.final_norm, dec.eps)
    logits = z @ dec.head_t
    return x, z, rf, logits, saved


def loss_and_grads(dec: DenseDecoder, ids: list[int], lora: Lora, backward: bool = True,
                   scored_from: int = 0, unlikely: bool = False) -> tuple[float, dict]:
    """Mean next-token cross-entropy of `ids` (teacher-forced, one sequence) under the LoRA, and its
    gradient with respect to every factor: {(layer, target): (dA, dB)} ({} without `backward`).
    scored_from: the loss counts the predictions of tokens from this position on (the earlier ones are
    context only). unlikely: the unlikelihood loss -log(1 - p(token)) instead (Welleck et al. 2019), which
    pushes the scored tokens down without pulling any other token up in particular (an answer rated bad)."""
    x, z, rf, logits, saved = _forward(dec, ids, lora, backward)
    T, (hq, hkv, d) = len(ids), (dec.num_heads, dec.num_kv_heads, dec.head_dim)
    group, scale = hq // hkv, np.float32(1.0 / np.sqrt(d))
    cos, sin = dec.cos[:T], dec.sin[:T]
    first = max(scored_from - 1, 0)  # the row predicting token `scored_from`
    targets = np.asarray(ids[first + 1:])
    lg = logits[first:-1]
    lg = lg - lg.max(-1, keepdims=True)
    logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
    n = len(targets)
    picked = logp[np.arange(n), targets]
    if unlikely:
        p_t = np.minimum(np.exp(picked), np.float32(1 - 1e-6))
        rest = 1 - p_t
        loss = float(-np.log1p(-p_t).mean())  # log1p: p_t is often tiny
    else:
        loss = float(-picked.mean())
    if not backward:
        return loss, {}
    dlogits = np.zeros_like(logits)
    # d(-log p_t)/dz = p - onehot; d(-log(1 - p_t))/dz = p_t / (1 - p_t) (onehot - p)
    weight = (-(p_t / rest) if unlikely else np.ones(n, np.float32))[:, None] / n
    dlogits[first:-1] = np.exp(logp) * weight
    dlogits[first + np.arange(n), targets] -= weight[:, 0]
    dx = _rms_back(dlogits @ dec.head_t.T, x, rf, dec.final_norm)
    grads: dict = {}

    def lora_back(dy: np.ndarray, cache: list, key: tuple[int, str]) -> np.ndarray | None:
        """Accumulate a target's factor gradients from its output gradient; the extra input gradient."""
        for k_, xin, tt in cache:
            if k_ == key:
                A, B = lora.factors[key]
                dt = lora.scale * (dy @ B)
                grads[key] = (dt.T @ xin, lora.scale * (dy.T @ tt))
                return dt @ A
        return None

    for i in reversed(range(lowest_layer(lora, len(dec.layers)), len(dec.layers))):
        L = dec.layers[i]
        x0, a, r1, qh, kh, vh, p, o, x1, m, r2, gate, up, sig, act, cache = saved[i]
        # MLP: x2 = x1 + down(act)
        dact = dx @ L["down_t"].T
        extra = lora_back(dx, cache, (i, "down_proj"))
        if extra is not None:
            dact += extra
        dgate = dact * up * sig * (1 + gate * (1 - sig))
        dup = dact * gate * sig
        dm = np.concatenate([dgate, dup], axis=1) @ L["gate_up_t"].T
        for t, dpart in (("gate_proj", dgate), ("up_proj", dup)):
            extra = lora_back(dpart, cache, (i, t))
            if extra is not None:
                dm += extra
        dx1 = dx + _rms_back(dm, x1, r2, L["post_norm"])
        # attention: x1 = x0 + o_proj(o)
        do = dx1 @ L["o_t"].T
        extra = lora_back(dx1, cache, (i, "o_proj"))
        if extra is not None:
            do += extra
        doh = np.ascontiguousarray(do.reshape(T, hq, d).transpose(1, 0, 2))  # [hq, T, d]
        dp = doh @ vh.transpose(0, 2, 1)  # [hq, T, T]
        dvh = p.transpose(0, 2, 1) @ doh  # [hq, T, d]
        ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
        dqr = (ds @ kh).transpose(1, 0, 2)  # [T, hq, d]
        dkh = ds.transpose(0, 2, 1) @ qh
        dkr = dkh.reshape(hkv, group, T, d).sum(1).transpose(1, 0, 2)  # the group's heads share a kv head
        dv = dvh.reshape(hkv, group, T, d).sum(1).transpose(1, 0, 2)
        dq = _rotate_back(dqr, cos, sin).reshape(T, hq * d)
        dk = _rotate_back(dkr, cos, sin).reshape(T, hkv * d)
        dv = dv.reshape(T, hkv * d)
        da = np.concatenate([dq, dk, dv], axis=1) @ L["qkv_t"].T
        for t, dpart in (("q_proj", dq), ("k_proj", dk), ("v_proj", dv)):
            extra = lora_back(dpart, cache, (i, t))
            if extra is not None:
                da += extra
        dx = dx1 + _rms_back(da, x0, r1, L["input_norm"])
    return loss, grads


def log_softmax_rows(dec: DenseDecoder, ids: list[int], lora: Lora) -> np.ndarray:
    """The model's next-token log-probabilities at every position of `ids` under the LoRA, [T, vocab]."""
    logits = _forward(dec, ids, lora, False)[3]
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def mean_kl(base_logp: np.ndarray, logp: np.ndarray) -> float:
    """The mean over positions of KL(base || adapted), in nats: how far an adapter moved the model."""
    return float((np.exp(base_logp) * (base_logp - logp)).sum(-1).mean())
