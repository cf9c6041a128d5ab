"""Activation-aware weight quantization (AWQ, Lin et al. 2023) for the decoder's MatMuls.

Round-to-nearest treats every weight alike, but a few input channels carry most of the activation
magnitude, and their weights' rounding error dominates the output error. AWQ multiplies each input
channel's weights by s = mean|x|^a before quantizing (a searched per layer group on calibration
activations) and divides the input by s, folded exactly into the operator that produces it (an RMSNorm
weight, or the rows of up_proj). A per-block clipping search then shrinks each block's range
where that lowers the block's output error. Both searches measure what the MatMulNBits kernel will
compute: asymmetric round-to-nearest over blocks along the input dimension, zero in range.

The folding changes what the LoRA path sees: a projection's input is x / s and up_proj's output
is divided by down_proj's scale. `LoraScales` records both so the LoRA graph undoes them
and adapters stay plain peft adapters.
"""

from __future__ import annotations

import importlib
import pydoc
from dataclasses import dataclass, field

import numpy as np

from runtime.errors import RuvLLMError

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
GRID = 20  # exponents a = 0, 0.05, ..., 0.95 (a = 0 is plain RTN: the search can only lower the error)
CLIP_GRID, CLIP_MAX_SHRINK = 20, 0.5  # block ranges shrunk by 0%, 5%, ..., 45%
CALIBRATION_TOKENS, SEQUENCE_LEN, SAMPLE_ROWS = 8192, 512, 1024
# Calibration text available offline wherever the exporter runs: the standard library's own documentation
# (English prose, signatures and code). --calibration FILE gives the exporter text of one's own instead.
CALIBRATION_MODULES = ("json", "collections", "itertools", "pathlib", "re", "string", "textwrap", "argparse",
                       "datetime", "functools", "logging", "subprocess", "typing", "dataclasses", "csv", "random",
                       "statistics", "shutil")


@dataclass
class LoraScales:
    """Per (layer, LoRA target): what the folded scales did to the projection's input and output."""

    inputs: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)  # the input is x / s: LoRA needs x
    outputs: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)  # the output is y / s: so must LoRA's


def calibration_ids(tokenizer, text_file: str | None = None, n_tokens: int = CALIBRATION_TOKENS) -> list[list[int]]:
    """Token sequences of SEQUENCE_LEN: the text file's, or the standard library's documentation."""
    if text_file:
        try:
            texts = [open(text_file, encoding="utf-8").read()]
        except OSError as err:
            raise RuvLLMError(f"--calibration {text_file}: {err.strerror or err}") from None
    else:
        texts = [pydoc.render_doc(importlib.import_module(m), renderer=pydoc.plaintext) for m in CALIBRATION_MODULES]
    ids: list[int] = []
    for text in texts:  # at most 2 sequences a module, so no one text dominates
        ids += tokenizer(text, add_special_tokens=False)["input_ids"][: 2 * SEQUENCE_LEN if not text_file else None]
    ids = ids[:n_tokens]
    if len(ids) < SEQUENCE_LEN // 4:
        raise RuvLLMError(f"calibration text too short: {len(ids)} tokens (AWQ wants a few thousand)")
    return [ids[i:i + SEQUENCE_LEN] for i in range(0, len(ids), SEQUENCE_LEN)]


def block_grid(x, bits: int):
    """Scale and zero point of MatMulNBits' asymmetric RTN for each block, x [..., block]: the block's
    range widened to hold zero (so zero padding changes nothing), in 2^bits - 1 steps."""
    import torch

    levels = 2 ** bits - 1
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
    scale = (hi - lo) / levels
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale, torch.round(-lo / scale).clamp(0, levels)


def fake_quantize(w, block: int, bits: int):
    """What MatMulNBits computes from w [out, in]: asymmetric RTN over blocks along `in`, zero in range."""
    import torch

    out_f, in_f = w.shape
    pad = -in_f % block
    x = torch.nn.functional.pad(w, (0, pad)).reshape(out_f, -1, block)
    scale, zero = (t[..., None] for t in block_grid(x, bits))
    q = torch.clamp(torch.round(x / scale + zero), 0, 2 ** bits - 1)
    return ((q - zero) * scale).reshape(out_f, -1)[:, :in_f]


class _Inputs:
    """Per-channel mean |x| over all calibration tokens and a fixed random sample of rows of x."""

    def __init__(self, keep: float, seed: int):
        import torch

        self.abs_sum, self.abs_max, self.count, self.rows, self.keep = None, None, 0, [], keep
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, module, args) -> None:
        import torch

        x = args[0].reshape(-1, args[0].shape[-1]).float()
        self.abs_sum = x.abs().sum(0) + (0 if self.abs_sum is None else self.abs_sum)
        top = x.abs().amax(0)
        self.abs_max = top if self.abs_max is None else torch.maximum(self.abs_max, top)
        self.count += x.shape[0]
        n = max(1, round(self.keep * x.shape[0]))
        self.rows.append(x[torch.randperm(x.shape[0], generator=self.gen)[:n]].clone())

    def sample(self):
        import torch

        return torch.cat(self.rows), self.abs_sum / self.count


def _search_scale(x, weights: list, mean_abs, block: int, bits: int):
    """The input-channel scale that minimizes the group's output error after quantization."""
    import torch

    ref = torch.cat([x @ w.T for w in weights], 1)
    best, best_err = None, float("inf")
    for k in range(GRID):
        s = mean_abs.clamp(min=1e-5) ** (k / GRID)
        s = s / (s.max() * s.min()).sqrt()
        out = torch.cat([(x / s) @ fake_quantize(w * s, block, bits).T for w in weights], 1)
        err = ((out - ref) ** 2).mean().item()
        if err < best_err:
            best, best_err = s, err
    return best


CLIP_ROWS = 1024  # output rows searched at a time (a 7B MLP's candidates at once would be GBs)


def _search_clip(x, w, block: int, bits: int, gram=None):
    """w with each block clipped to the range (shrunk symmetrically) that minimizes its output error; a
    block's search sees only its own row, so the rows go CLIP_ROWS at a time.

    A block's error over the calibration rows, mean_n (x_n . (q - w))^2, is d^T G d with d = q - w and G the
    block's input Gram matrix (mean of x x^T over the rows): computed from G, each candidate costs a block's
    width per weight rather than a calibration row's product per weight and row (16x fewer at 1,024 rows and
    blocks of 64; SmolLM2's AWQ export 240 -> ~130 s here)."""
    import torch

    out_f, in_f = w.shape
    pad = -in_f % block
    if gram is None:
        xb = torch.nn.functional.pad(x, (0, pad)).reshape(x.shape[0], -1, block)  # [n, blocks, block]
        gram = torch.einsum("ngb,ngc->gbc", xb, xb) / x.shape[0]  # [blocks, block, block]
    if out_f > CLIP_ROWS:
        return torch.cat([_search_clip(x, w[r:r + CLIP_ROWS], block, bits, gram) for r in range(0, out_f, CLIP_ROWS)])
    wb = torch.nn.functional.pad(w, (0, pad)).reshape(out_f, -1, block)  # [out, blocks, block]
    full = wb.abs().amax(-1, keepdim=True)
    best_err = torch.full(wb.shape[:2], float("inf"))
    best_max = full.clone()
    for k in range(int(CLIP_MAX_SHRINK * CLIP_GRID)):
        limit = full * (1 - k / CLIP_GRID)
        d = fake_quantize(torch.clamp(wb, -limit, limit).reshape(out_f, -1), block, bits).reshape(wb.shape) - wb
        err = (torch.einsum("ogb,gbc->ogc", d, gram) * d).sum(-1)  # [out, blocks]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better[..., None], limit, best_max)
    return torch.clamp(wb, -best_max, best_max).reshape(out_f, -1)[:, :in_f]


def layer_probes(i: int, layer, keep: float) -> tuple[dict, list]:
    """`_Inputs` on a layer's projection inputs, by (layer, group), and the hooks that feed them."""
    probes, hooks = {}, []
    for name, module in (("qkv", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj),
                         ("gate_up", layer.mlp.gate_proj), ("down", layer.mlp.down_proj)):
        probes[i, name] = _Inputs(keep, seed=i)
        hooks.append(module.register_forward_pre_hook(probes[i, name]))
    return probes, hooks


def sample_share(sequences: list[list[int]]) -> float:
    """The share of calibration rows `_Inputs` keeps: SAMPLE_ROWS in all."""
    return min(1.0, SAMPLE_ROWS / sum(len(s) for s in sequences))


def _calibrate(model, sequences: list[list[int]], progress: bool, what: str) -> dict:
    """Each layer's projection inputs on the calibration text: `_Inputs` by (layer, group)."""
    import torch

    from exporter.progress import stage

    keep = sample_share(sequences)
    probes, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        found, added = layer_probes(i, layer, keep)
        probes.update(found)
        hooks += added
    try:
        with torch.no_grad():
            for seq in stage(f"{what} calibration", sequences, enabled=progress):
                model(torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    return probes


def _groups(layer):
    """(group, the operator producing its input, its projections): q/k/v share the input RMSNorm, gate/up
    the norm before the MLP; down's input is divided through up_proj's output rows. (o_proj's through
    v_proj's, one scale per kv-head channel, measured within noise on SmolLM2 at blocks of 128: perplexity
    16.89 vs 17.01 on 7k tokens, 8.31 vs 8.28 on the tests' text; so o_proj is not scaled.)"""
    return (("qkv", layer.input_layernorm, ("q_proj", "k_proj", "v_proj")),
            ("gate_up", getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm,
             ("gate_proj", "up_proj")),
            ("down", layer.mlp.up_proj, ("down_proj",)))


def _fold(i: int, name: str, producer, linears, mods, s, scales: LoraScales) -> None:
    """Multiply the projections' input channels by s and divide the input by s where it is made: the
    float model computes the same, and LoraScales records it for the LoRA path."""
    for t, m in zip(linears, mods):
        m.weight.mul_(s)
        scales.inputs[i, t] = s.numpy().copy()
    if name == "down":
        producer.weight.div_(s[:, None])
        scales.outputs[i, "up_proj"] = s.numpy().copy()
    elif type(producer).__name__ in ("GemmaRMSNorm", "Gemma2RMSNorm"):  # it scales by (1 + w)
        producer.weight.copy_((1 + producer.weight) / s - 1)
    else:
        producer.weight.div_(s)


def apply_awq(model, sequences: list[list[int]], block: int, bits: int, clip: bool = True,
              progress: bool = False, mlp_block: int | None = None) -> LoraScales:
    """Scale (and clip) the weights of a Llama-family `transformers` model in place for `bits`-bit
    quantization in blocks of `block` (the MLP's in blocks of `mlp_block` if given). The scaling leaves
    the float model's outputs unchanged (up to rounding); the clipping moves weights to where their
    quantization errs least."""
    from exporter.progress import stage

    probes = _calibrate(model, sequences, progress, "AWQ")
    scales = LoraScales()
    for i, layer in enumerate(stage("AWQ search (layers)", model.model.layers, enabled=progress)):
        awq_layer(i, layer, probes, block, bits, clip, mlp_block, scales)
    return scales


def awq_layer(i: int, layer, probes: dict, block: int, bits: int, clip: bool, mlp_block: int | None,
              scales: LoraScales) -> None:
    """One layer's AWQ, in place: each group's scale searched on its probed inputs (layer_probes) and
    folded, then the blocks' clipping; the layer's probes are consumed."""
    import torch

    width = {"qkv": block, "o": block, "gate_up": mlp_block or block, "down": mlp_block or block}
    with torch.no_grad():
        attn, mlp = layer.self_attn, layer.mlp
        x = {}
        for name, producer, linears in _groups(layer):
            mods = [getattr(attn if t in ATTN else mlp, t) for t in linears]
            sample, mean_abs = probes.pop((i, name)).sample()
            s = _search_scale(sample, [m.weight for m in mods], mean_abs, width[name], bits)
            _fold(i, name, producer, linears, mods, s, scales)
            x[name] = sample / s
        x["o"] = probes.pop((i, "o")).sample()[0]
        if not clip:
            return
        # q/k stay unclipped: their error moves attention scores, which a block's output error misses
        for name, m in (("qkv", attn.v_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_proj),
                        ("gate_up", mlp.up_proj), ("down", mlp.down_proj)):
            m.weight.copy_(_search_clip(x[name], m.weight, width[name], bits))


SMOOTHQUANT_ALPHA = 0.5  # the paper's default: outliers' difficulty split evenly between x and w


def apply_smoothquant(model, sequences: list[list[int]], alpha: float = SMOOTHQUANT_ALPHA,
                      progress: bool = False) -> LoraScales:
    """SmoothQuant (Xiao et al. 2023) for W8A8: per input channel s = max|x|^alpha / max|w|^(1 - alpha),
    folded as AWQ folds its scales (x / s where x is made, w * s). Activation outliers move into the
    weights, where int8 per output channel holds them, so int8 activations per row lose less."""
    import torch

    probes = _calibrate(model, sequences, progress, "SmoothQuant")
    scales = LoraScales()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for name, producer, linears in _groups(layer):
                mods = [getattr(attn if t in ATTN else mlp, t) for t in linears]
                x_max = probes.pop((i, name)).abs_max.clamp(min=1e-5)
                w_max = torch.stack([m.weight.abs().amax(0) for m in mods]).amax(0).clamp(min=1e-5)
                s = (x_max ** alpha / w_max ** (1 - alpha)).clamp(min=1e-5)
                _fold(i, name, producer, linears, mods, s, scales)
            probes.pop((i, "o"))
    return scales
