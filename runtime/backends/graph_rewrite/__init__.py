"""Rewrites a package's graph onto RuvLLM's CPU kernels (kernel_library.py), and counts what can be
rewritten, so that the exporter can declare it in the manifest and the runtime can refuse to run a
declared fusion silently slower.

Each pass (one module each) matches the shape the exporter builds (exporter/builders/,
exporter/quantizers/block_matmul.py) and replaces it with one of the `ruvllm` operators; a graph of another
shape is left as it is, and the count says so. `fuse()` runs the declared PASSES in order; `portable` turns
the exporter's kernel layouts back into standard operators for a host without the kernels, and `cache`
keeps a rewritten graph for the next load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from runtime.backends.graph_rewrite.attention import fusable_head_dim, fuse_attention
from runtime.backends.graph_rewrite.cache import rewrite_graph
from runtime.backends.graph_rewrite.kv_dtype import kv_in_int8_graph, kv_quantized
from runtime.backends.graph_rewrite.lora import adapters_in_half, fuse_lora, fuse_lora_split, fuse_lora_swiglu
from runtime.backends.graph_rewrite.matmul import fuse_epilogues, fuse_matmuls, fuse_minimums
from runtime.backends.graph_rewrite.nodes import ALL_OPS, DOMAIN
from runtime.backends.graph_rewrite.norms import fuse_norms
from runtime.backends.graph_rewrite.portable import portable_graph
from runtime.backends.graph_rewrite.sampling import fuse_sampling

__all__ = ["ALL_OPS", "PASSES", "Rewrite", "declared_fusions", "fusable_head_dim", "fuse", "kv_in_int8_graph",
           "rewrite_graph"]


@dataclass
class Rewrite:
    """One rewrite's graph, what it was asked for and what the passes before have counted."""

    model: object
    config: dict | None
    ops: frozenset[str]
    base_dir: Path | None
    half_adapters: bool
    kv_dtype: str
    kv_tails: bool
    weights: dict | None
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    """A pass: the count it reports (None: it counts nothing) and what it does to a Rewrite."""

    count: str | None
    run: Callable[[Rewrite], int | None]


def _portable(r: Rewrite) -> None:
    if "MatMulQ4" not in r.ops:  # layouts only the kernel reads (a GGUF's Q4_K) become MatMulNBits
        portable_graph(r.model, r.base_dir, r.weights)


def _matmuls(r: Rewrite) -> int:
    q4, q8 = fuse_matmuls(r.model, r.ops, r.base_dir)
    r.counts["MatMulQ8"] = q8
    if q4:
        fuse_minimums(r.model)
        fuse_epilogues(r.model)  # the exporter's MatMulQ4 as well
    return q4


def _attention(r: Rewrite) -> int:
    cfg = r.config
    if "PagedAttention" not in r.ops or cfg is None or not fusable_head_dim(cfg.get("head_dim", 0)):
        return 0
    windows = cfg.get("layer_windows") or [cfg.get("sliding_window")] * cfg["num_layers"]
    return fuse_attention(r.model, cfg["num_layers"], cfg["num_heads"], cfg["num_kv_heads"], windows)


def _kv(r: Rewrite) -> None:
    if r.kv_dtype not in ("int8", "int4"):
        return
    if r.counts["PagedAttention"]:  # on the kernel's layers, else (int8, no kernel) on the graph's own attention
        kv_quantized(r.model, r.config["num_layers"], r.kv_tails, r.kv_dtype)
    if r.kv_dtype == "int8":
        kv_in_int8_graph(r.model)


def _lora_half(r: Rewrite) -> None:
    if r.counts["LoraDelta"] and r.half_adapters:
        adapters_in_half(r.model)


# in order; a pass reads the counts of those before it
PASSES: tuple[Pass, ...] = (
    Pass(None, _portable),
    Pass("MatMulQ4", _matmuls),  # and MatMulQ8
    Pass("PagedAttention", _attention),
    Pass(None, _kv),
    Pass("SkipRMSNorm", lambda r: fuse_norms(r.model) if "SkipRMSNorm" in r.ops else 0),
    Pass("LoraDelta", lambda r: fuse_lora(r.model) if "LoraDelta" in r.ops else 0),
    # the same kernel file as LoraDelta: every build that has it has these
    Pass("LoraSwiGLU", lambda r: fuse_lora_swiglu(r.model) if r.counts["LoraDelta"] else 0),
    Pass("LoraSplit", lambda r: fuse_lora_split(r.model) if r.counts["LoraDelta"] else 0),
    Pass(None, _lora_half),
    Pass("SampleTopK", lambda r: fuse_sampling(r.model) if "SampleTopK" in r.ops else 0),
)


def fuse(model, config: dict | None = None, ops: frozenset[str] = ALL_OPS, base_dir: Path | None = None,
         half_adapters: bool = False, kv_dtype: str = "fp32", kv_tails: bool = True,
         weights: dict | None = None) -> dict[str, int]:
    """Rewrite `model` in place with the operators in `ops`: every MatMulNBits the kernel computes the
    same way becomes ruvllm.MatMulQ4 (with its epilogues and block minimums folded in), and, given the
    package's config, each layer's attention ruvllm.PagedAttention (fuse_attention) and each residual
    add + RMS norm ruvllm.SkipRMSNorm, and the sampling tail ruvllm.SampleTopK (fuse_sampling). Returns how
    many of each were replaced.

    `base_dir` is where the graph's external data lives (a Q8_0's zero points are read there).
    `half_adapters`: the LoRA graph's adapter inputs that only RuvLLM's LoRA operators read become fp16
    (adapters_in_half). `kv_dtype` "int8" or "int4": the KV pool inputs that only ruvllm.PagedAttention
    reads become int8 (int4: packed in uint8) with their group scales (kv_quantized, with fp16 tails unless
    `kv_tails` is False); an int8 pool elsewhere is read by the graph's own attention (kv_in_int8_graph).
    `weights`: where the weights made for a host without the kernels go, in memory rather than in the graph
    (portable.portable_graph).
    """
    import onnx

    r = Rewrite(model, config, ops, base_dir, half_adapters, kv_dtype, kv_tails, weights)
    for p in PASSES:
        done = p.run(r)
        if p.count is not None:
            r.counts[p.count] = done
    counts = dict(r.counts)  # the passes' own, MatMulQ8 the projections'
    if any(counts.values()) and DOMAIN not in {o.domain for o in model.opset_import}:
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return counts


def declared_fusions(graph: Path, config: dict) -> dict[str, int]:
    """What fuse() replaces in this graph with every operator: the exporter writes it into the manifest."""
    import onnx

    return fuse(onnx.load(str(graph), load_external_data=False), config, base_dir=graph.parent)
