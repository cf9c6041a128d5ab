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

# packages written before the manifest said how its decoder computes (config["compute"]): these computed as a
# Llama does; any other is refused rather than computed wrong
LEGACY_ARCHITECTURES = ("llama", "mistral", "qwen2")
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's activations the backward differentiates
LLAMA_COMPUTE = {"activation": "silu", "embed_scale": 1.0, "attn_scale": None, "qk_norm": False,
                 "sandwich_norms": False, "layer_rope_local": None}


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


class FrozenPrefix:
    """The residual stream where the lowest adapted layer reads it, per text, up to a byte budget (least
    recently used out first). Nothing below that layer has a factor, so a text's stream there is the same
    at every step: the epochs after the first over a feedback, and EWC++'s reference read again at every
    refresh, run only the adapted layers."""

    def __init__(self, budget_bytes: int = 64 * 2 ** 20) -> None:
        from collections import OrderedDict

        self.budget, self.used, self.kept = budget_bytes, 0, OrderedDict()

    def get(self, key) -> np.ndarray | None:
        got = self.kept.get(key)
        if got is not None:
            self.kept.move_to_end(key)
        return got

    def put(self, key, x: np.ndarray) -> None:
        if key in self.kept or x.nbytes > self.budget:
            return
        self.kept[key] = x
        self.used += x.nbytes
        while self.used > self.budget:
            self.used -= self.kept.popitem(last=False)[1].nbytes


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
class Compute:
    """How the decoder computes beyond its projections, as its manifest says (exporter/writers/manifest.py:
    compute_traits): the backward reads these, never the architecture's name."""

    activation: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    qk_norm: bool = False  # an RMS norm over each query and key head before RoPE
    sandwich_norms: bool = False  # attention's and the MLP's outputs normed before their residual adds
    windows: list = field(default_factory=list)  # per layer: a sliding window's width, or None
    rope_local: list = field(default_factory=list)  # per layer: whether it reads rope_local's tables
    attn_softcap: float | None = None
    final_softcap: float | None = None

    @classmethod
    def from_manifest(cls, path, manifest: dict) -> Compute:
        cfg, n = manifest["config"], manifest["config"]["num_layers"]
        traits = cfg.get("compute")
        if traits is None:
            if manifest["architecture"] not in LEGACY_ARCHITECTURES:
                raise PackageError(f"{path}: this {manifest['architecture']} package predates the manifest's "
                                   f"config.compute; export it again to adapt its LoRA")
            traits = LLAMA_COMPUTE
        if traits["activation"] not in ACTIVATIONS:
            raise PackageError(f"{path}: adapting a LoRA through the {traits['activation']!r} activation is not "
                               f"supported (only {', '.join(ACTIVATIONS)})")
        windows = cfg.get("layer_windows") or [cfg.get("sliding_window")] * n
        return cls(traits["activation"], traits["embed_scale"], traits["attn_scale"], traits["qk_norm"],
                   traits["sandwich_norms"], list(windows), list(traits["layer_rope_local"] or [False] * n),
                   cfg.get("attn_softcap"), cfg.get("final_softcap"))


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
    compute: Compute = field(default_factory=Compute)
    local_cos: np.ndarray | None = None  # the sliding layers' own rotary tables (Gemma 3), when any reads them
    local_sin: np.ndarray | None = None
    prefix: FrozenPrefix = field(default_factory=FrozenPrefix)

    @classmethod
    def from_package(cls, pkg, budget_bytes: int | None = None) -> DenseDecoder:
        m, cfg = pkg.manifest, pkg.config
        compute = Compute.from_manifest(pkg.path, m)
        w = GraphWeights(pkg.file(m["graphs"]["decoder"]["file"]))
        hq, hkv, d, f = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["intermediate_size"]
        h = cfg["hidden_size"]
        features = {"q_proj": (h, hq * d), "k_proj": (h, hkv * d), "v_proj": (h, hkv * d), "o_proj": (hq * d, h),
                    "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
        cache = DenseCache(default_budget() if budget_bytes is None else budget_bytes)
        local = (w.array("rope_local.cos"), w.array("rope_local.sin")) if any(compute.rope_local) else (None, None)
        return cls(w, cache, cfg["num_layers"], w.array("model.norm"), w.array("rope.cos"), w.array("rope.sin"),
                   hq, hkv, d, f, cfg["rms_norm_eps"], features, compute, *local)

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
        if self.compute.qk_norm:  # the graph's [Hq + Hkv, D]: each head's row of its kind's weights
            layer["qk_norm"] = w.array(p + "qk_norm").reshape(self.num_heads + self.num_kv_heads, self.head_dim)
        if self.compute.sandwich_norms:
            layer["pre_ff_norm"] = w.array(p + "pre_feedforward_layernorm")
            layer["post_ff_norm"] = w.array(p + "post_feedforward_layernorm")
        return layer

    def projection(self, layer: int, target: str) -> np.ndarray:
        """A target's weight [in, out] in layer `layer` (a view into the fused matrix that holds it)."""
        L, hq, hkv, d, f = self.layers[layer], self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate
        cols = {"q_proj": ("qkv_t", 0, hq * d), "k_proj": ("qkv_t", hq * d, (hq + hkv) * d),
                "v_proj": ("qkv_t", (hq + hkv) * d, (hq + 2 * hkv) * d), "o_proj": ("o_t", 0, None),
                "gate_proj": ("gate_up_t", 0, f), "up_proj": ("gate_up_t", f, 2 * f), "down_proj": ("down_t", 0, None)}
        name, lo, hi = cols[target]
        return L[name][:, lo:hi]

    def rope(self, layer: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s rotary tables for positions 0..T-1."""
        if self.compute.rope_local and self.compute.rope_local[layer]:
            return self.local_cos[:T], self.local_sin[:T]
        return self.cos[:T], self.sin[:T]

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


_GELU_C = np.float32(np.sqrt(2 / np.pi))


def _activate(gate: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The gate's activation and its derivative: SiLU, or GELU's tanh approximation (Gemma's GeGLU)."""
    if kind == "silu":
        sig = 1.0 / (1.0 + np.exp(-gate))
        return gate * sig, sig * (1 + gate * (1 - sig))
    th = np.tanh(_GELU_C * (gate + np.float32(0.044715) * gate ** 3))
    slope = 0.5 * (1 + th) + 0.5 * gate * (1 - th * th) * _GELU_C * (1 + np.float32(3 * 0.044715) * gate * gate)
    return 0.5 * gate * (1 + th), slope


def _mask(T: int, window: int | None) -> np.ndarray:
    """Causal, and within `window` positions back when the layer slides (the graph's rule: q - k < window)."""
    pos = np.arange(T)
    allowed = pos[None, :] <= pos[:, None]
    if window:
        allowed &= pos[None, :] > pos[:, None] - window
    return np.where(allowed, np.float32(0), np.float32(-np.inf))


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
    lowest adapted layer on; None below it), the soft-capped logits' tanh (None without a cap))."""
    T = len(ids)
    if T < 2:
        raise ValueError("a text of at least two tokens")
    if T > dec.cos.shape[0]:
        raise ValueError(f"{T} tokens is past the model's {dec.cos.shape[0]} positions")
    hq, hkv, d, F, c = dec.num_heads, dec.num_kv_heads, dec.head_dim, dec.intermediate, dec.compute
    group = hq // hkv
    scale = np.float32(c.attn_scale or 1.0 / np.sqrt(d))  # an np.float64 would make the stream float64
    masks = {w: _mask(T, w) for w in dict.fromkeys(c.windows)}
    lowest = lowest_layer(lora, len(dec.layers))
    key = (lowest, np.asarray(ids, np.int64).tobytes())
    x = dec.prefix.get(key) if lowest > 0 else None
    start = 0 if x is None else lowest
    if x is None:
        x = dec.embed_rows(ids)
        if c.embed_scale != 1.0:
            x = x * np.float32(c.embed_scale)
    saved = [None] * start
    for i in range(start, len(dec.layers)):
        L = dec.layers[i]
        if i == lowest:
            dec.prefix.put(key, x)
        s_: dict = {"x0": x, "lora": []}
        a, r1 = _rms(x, L["input_norm"], dec.eps)
        qkv = a @ L["qkv_t"]
        if "qkv_bias" in L:
            qkv = qkv + L["qkv_bias"]
        q, k, v = np.split(qkv, [hq * d, (hq + hkv) * d], axis=1)
        for t, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            _add_lora(a, part, lora, (i, t), s_["lora"])
        q3, k3 = q.reshape(T, hq, d), k.reshape(T, hkv, d)
        if c.qk_norm:
            q3n, rq = _rms(q3, L["qk_norm"][:hq], dec.eps)
            k3n, rk = _rms(k3, L["qk_norm"][hq:], dec.eps)
            s_.update(q3=q3, k3=k3, rq=rq, rk=rk)
            q3, k3 = q3n, k3n
        cos, sin = dec.rope(i, T)
        qr, kr = _rotate(q3, cos, sin), _rotate(k3, cos, sin)
        vv = v.reshape(T, hkv, d)
        qh = np.ascontiguousarray(qr.transpose(1, 0, 2))  # [hq, T, d]: batched matmuls, not einsum's loops
        kh = np.ascontiguousarray(np.repeat(kr, group, axis=1).transpose(1, 0, 2))
        vh = np.ascontiguousarray(np.repeat(vv, group, axis=1).transpose(1, 0, 2))
        s = qh @ kh.transpose(0, 2, 1) * scale  # [hq, T, T]
        if c.attn_softcap:
            s_["cap"] = np.tanh(s / np.float32(c.attn_softcap))
            s = s_["cap"] * np.float32(c.attn_softcap)
        s = s + masks[c.windows[i]]
        s -= s.max(-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(-1, keepdims=True)
        o = (p @ vh).transpose(1, 0, 2).reshape(T, hq * d)
        y = _add_lora(o, o @ L["o_t"], lora, (i, "o_proj"), s_["lora"])
        if c.sandwich_norms:
            yn, s_["r_pa"] = _rms(y, L["post_norm"], dec.eps)
            x1 = x + yn
            m, r2 = _rms(x1, L["pre_ff_norm"], dec.eps)
        else:
            x1 = x + y
            m, r2 = _rms(x1, L["post_norm"], dec.eps)
        gu = m @ L["gate_up_t"]
        gate, up = gu[:, :F], gu[:, F:]
        for t, part in (("gate_proj", gate), ("up_proj", up)):
            _add_lora(m, part, lora, (i, t), s_["lora"])
        g, slope = _activate(gate, c.activation)
        act = g * up
        z = _add_lora(act, act @ L["down_t"], lora, (i, "down_proj"), s_["lora"])
        if c.sandwich_norms:
            zn, s_["r_pf"] = _rms(z, L["post_ff_norm"], dec.eps)
            x2 = x1 + zn
        else:
            x2 = x1 + z
        if keep:  # what the backward reads (a scoring pass keeps nothing: 2,048 tokens' scores are GBs)
            s_.update(a=a, r1=r1, qh=qh, kh=kh, vh=vh, p=p, y=y, x1=x1, m=m, r2=r2, g=g, slope=slope, up=up, z=z)
            saved.append(None if i < lowest else s_)
        x = x2
    zf, rf = _rms(x, dec.final_norm, dec.eps)
    logits = zf @ dec.head_t
    capped = None
    if c.final_softcap:
        capped = np.tanh(logits / np.float32(c.final_softcap))
        logits = capped * np.float32(c.final_softcap)
    return x, zf, rf, logits, saved, capped


def loss_and_grads(dec: DenseDecoder, ids: list[int], lora: Lora, backward: bool = True,
                   scored_from: int = 0, unlikely: bool = False) -> tuple[float, dict]:
    """Mean next-token cross-entropy of `ids` (teacher-forced, one sequence) under the LoRA, and its
    gradient with respect to every factor: {(layer, target): (dA, dB)} ({} without `backward`).
    scored_from: the loss counts the predictions of tokens from this position on (the earlier ones are
    context only). unlikely: the unlikelihood loss -log(1 - p(token)) instead (Welleck et al. 2019), which
    pushes the scored tokens down without pulling any other token up in particular (an answer rated bad)."""
    x, z, rf, logits, saved, capped = _forward(dec, ids, lora, backward)
    T, (hq, hkv, d), c = len(ids), (dec.num_heads, dec.num_kv_heads, dec.head_dim), dec.compute
    group, scale = hq // hkv, np.float32(c.attn_scale or 1.0 / np.sqrt(d))
    first = max(scored_from - 1, 0)  # the row predicting token `scored_from`
    targets = np.asarray(ids[first + 1:])
    n = len(targets)
    # the softmax in place in the logits, which then become their own gradient: a [T, vocab] array is the
    # step's largest (50 MB at 256 tokens of SmolLM2's vocabulary), so none is made again
    lg = logits[first:-1]
    lg -= lg.max(-1, keepdims=True)
    picked = lg[np.arange(n), targets].copy()
    np.exp(lg, out=lg)
    total = lg.sum(-1, keepdims=True)
    picked -= np.log(total[:, 0])  # log p of each target
    if unlikely:
        p_t = np.minimum(np.exp(picked), np.float32(1 - 1e-6))
        rest = 1 - p_t
        loss = float(-np.log1p(-p_t).mean())  # log1p: p_t is often tiny
    else:
        loss = float(-picked.mean())
    if not backward:
        return loss, {}
    # d(-log p_t)/dz = p - onehot; d(-log(1 - p_t))/dz = p_t / (1 - p_t) (onehot - p)
    weight = (-(p_t / rest) if unlikely else np.ones(n, np.float32))[:, None] / n
    lg *= (weight / total).astype(np.float32)
    lg[np.arange(n), targets] -= weight[:, 0]
    logits[:first] = 0
    logits[-1] = 0
    dlogits = logits
    if capped is not None:  # logits = cap tanh(raw / cap)
        dlogits *= 1 - capped * capped
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

    def through(dy: np.ndarray, cache: list, key: tuple[int, str], weight_t: np.ndarray) -> np.ndarray:
        """The input gradient of a projection (base weight and LoRA), the LoRA's factor gradients taken."""
        din = dy @ weight_t.T
        extra = lora_back(dy, cache, key)
        return din if extra is None else din + extra

    for i in reversed(range(lowest_layer(lora, len(dec.layers)), len(dec.layers))):
        L, S = dec.layers[i], saved[i]
        cache = S["lora"]
        # MLP: x2 = x1 + [post_ff_norm](down(act))
        dz = _rms_back(dx, S["z"], S["r_pf"], L["post_ff_norm"]) if c.sandwich_norms else dx
        dact = through(dz, cache, (i, "down_proj"), L["down_t"])
        dgate = dact * S["up"] * S["slope"]
        dup = dact * S["g"]
        dm = np.concatenate([dgate, dup], axis=1) @ L["gate_up_t"].T
        for t, dpart in (("gate_proj", dgate), ("up_proj", dup)):
            extra = lora_back(dpart, cache, (i, t))
            if extra is not None:
                dm += extra
        dx1 = dx + _rms_back(dm, S["x1"], S["r2"], L["pre_ff_norm" if c.sandwich_norms else "post_norm"])
        # attention: x1 = x0 + [post_attention_norm](o_proj(o))
        dy = _rms_back(dx1, S["y"], S["r_pa"], L["post_norm"]) if c.sandwich_norms else dx1
        do = through(dy, cache, (i, "o_proj"), L["o_t"])
        p, vh, kh, qh = S["p"], S["vh"], S["kh"], S["qh"]
        doh = np.ascontiguousarray(do.reshape(T, hq, d).transpose(1, 0, 2))  # [hq, T, d]
        dp = doh @ vh.transpose(0, 2, 1)  # [hq, T, T]
        dvh = p.transpose(0, 2, 1) @ doh  # [hq, T, d]
        ds = p * (dp - (dp * p).sum(-1, keepdims=True))
        if c.attn_softcap:
            ds *= 1 - S["cap"] * S["cap"]
        ds *= scale
        dqr = (ds @ kh).transpose(1, 0, 2)  # [T, hq, d]
        dkh = ds.transpose(0, 2, 1) @ qh
        dkr = dkh.reshape(hkv, group, T, d).sum(1).transpose(1, 0, 2)  # the group's heads share a kv head
        dv = dvh.reshape(hkv, group, T, d).sum(1).transpose(1, 0, 2)
        cos, sin = dec.rope(i, T)
        dq3, dk3 = _rotate_back(dqr, cos, sin), _rotate_back(dkr, cos, sin)
        if c.qk_norm:
            dq3 = _rms_back(dq3, S["q3"], S["rq"], L["qk_norm"][:hq])
            dk3 = _rms_back(dk3, S["k3"], S["rk"], L["qk_norm"][hq:])
        dq, dk, dv = dq3.reshape(T, hq * d), dk3.reshape(T, hkv * d), dv.reshape(T, hkv * d)
        da = np.concatenate([dq, dk, dv], axis=1) @ L["qkv_t"].T
        for t, dpart in (("q_proj", dq), ("k_proj", dk), ("v_proj", dv)):
            extra = lora_back(dpart, cache, (i, t))
            if extra is not None:
                da += extra
        dx = dx1 + _rms_back(da, S["x0"], S["r1"], L["input_norm"])
    return loss, grads


def log_softmax_rows(dec: DenseDecoder, ids: list[int], lora: Lora) -> np.ndarray:
    """The model's next-token log-probabilities at every position of `ids` under the LoRA, [T, vocab]."""
    logits = _forward(dec, ids, lora, False)[3]
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def mean_kl(base_logp: np.ndarray, logp: np.ndarray) -> float:
    """The mean over positions of KL(base || adapted), in nats: how far an adapter moved the model."""
    return float((np.exp(base_logp) * (base_logp - logp)).sum(-1).mean())
