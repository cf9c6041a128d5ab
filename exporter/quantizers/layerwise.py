"""AWQ and GPTQ over a model read tensor by tensor: one decoder layer in float at a time.

The whole-model path (convert.py) loads every weight in fp32 (a 3B model is 12 GB before the graphs
copy it). Here the model is transformers' own module tree with no weights (streamed.skeleton); the
calibration text runs through the layers one at a time, as the methods' reference implementations do
(AutoAWQ, GPTQ's own code): a layer's weights are read from the source, its inputs (the previous
layer's outputs, kept for every calibration token) give the search its activations, the layer is
quantized, and its weights are dropped before the next is read. Memory is one layer's weights and the
calibration hidden states (tokens x hidden x 4 bytes a stream), whatever the model's size.

AWQ calibrates on the float model's activations (each layer's outputs before its scales and clipping),
GPTQ on the quantized layers' outputs, each in its own stream of hidden states, as the whole-model path
does. What differs: GPTQ calibrates on the calibration text alone, not on samples of the model's own
text (sampling needs the whole model at every token); the manifest says so.
"""

from __future__ import annotations

import numpy as np

from exporter.builders.spec import FUSED_PROJECTIONS
from exporter.heap import map_large_blocks, release_freed
from exporter.quantizers.awq import LoraScales, awq_layer, layer_probes, sample_share
from exporter.quantizers.gptq import capture_first_layer, gptq_layer, layer_output
from exporter.quantizers.grid import Grid, rtn_grid
from exporter.quantizers.quantize import MLP_WEIGHTS

GPTQ_CALIBRATION = "the calibration text alone (layer by layer: no samples of the model's own)"


class LayerwiseQuantizer:
    """The projections' grids and the folded float weights (AWQ's norms) of each layer, made in layer
    order the first time any of a layer's weights is asked for."""

    def __init__(self, model, tensors, method: str, sequences: list[list[int]], block: int, bits: int,
                 mlp_block: int | None = None, progress: bool = False) -> None:
        """model: streamed.skeleton's (no weights); tensors: a GgufTensors or SafetensorsTensors on the
        source; method: awq, gptq or awq+gptq."""
        map_large_blocks()  # the process exports a model too large to load whole: its temporaries given back when freed
        self.model, self.tensors, self.method = model, tensors, method
        self.block, self.bits, self.mlp_block = block, bits, mlp_block
        self.scales = LoraScales()
        self.grids: dict[str, Grid] = {}  # by graph weight name, e.g. layers.3.qkv_proj
        self.folded: dict[str, np.ndarray] = {}  # Hugging Face name -> the weight as the methods left it
        self.done = 0  # layers quantized
        self.keep = sample_share(sequences)
        self.bar = None
        if progress:
            from exporter.progress import stage

            self.bar = stage(f"{method.upper()} (layers, streamed)", total=len(model.model.layers))
        with self._loaded(model.model, prefix="model.", skip="layers."):  # the embedding and what precedes layer 0
            first = capture_first_layer(model, sequences)
        self.awq = list(first) if "awq" in method else None  # the float model's activations
        self.gptq = first if "gptq" in method else None  # the quantized layers' outputs

    # ---- what the graph builder reads ----
    def grid(self, name: str) -> Grid:
        """A graph weight's grid (`layers.{i}.{qkv_proj|o_proj|gate_up_proj|down_proj}`)."""
        self.ensure(int(name.split(".")[1]))
        return self.grids.pop(name)

    def weight(self, hf_name: str) -> np.ndarray | None:
        """A layer weight as the methods left it (an AWQ-folded norm), or None where they did not touch it."""
        if hf_name.startswith("model.layers."):
            self.ensure(int(hf_name.split(".")[2]))
        return self.folded.get(hf_name)

    def ensure(self, layer: int) -> None:
        while self.done <= layer:
            self._quantize(self.done)
            self.done += 1
            if self.bar is not None:
                self.bar.update(1)
            if self.done == len(self.model.model.layers):  # the calibration streams are not needed further
                self.awq = self.gptq = None
                if self.bar is not None:
                    self.bar.close()

    # ---- one layer ----
    def _quantize(self, i: int) -> None:
        import torch

        layer = self.model.model.layers[i]
        prefix = f"model.layers.{i}."
        with self._loaded(layer, prefix), torch.no_grad():
            if self.awq is not None:
                probes, hooks = layer_probes(i, layer, self.keep)
                try:
                    self.awq = [(layer_output(layer(h, **kw)), kw) for h, kw in self.awq]
                finally:
                    for h in hooks:
                        h.remove()
                awq_layer(i, layer, probes, self.block, self.bits, True, self.mlp_block, self.scales)
                for name, p in layer.named_parameters():  # the folds: norms (and up_proj, quantized below)
                    if p.ndim == 1:
                        self.folded[prefix + name] = p.detach().numpy().copy()
            if self.gptq is not None:
                found, self.gptq = gptq_layer(i, layer, self.gptq, self.block, self.bits, self.mlp_block)
                self.grids.update(found)
            else:  # AWQ alone: round-to-nearest of the scaled and clipped weights, as the whole-model path
                for fused, parts in FUSED_PROJECTIONS.items():
                    name = f"layers.{i}.{fused}"
                    w = np.concatenate([layer.get_submodule(p).weight.detach().numpy() for p in parts])
                    block = (self.mlp_block or self.block) if name.endswith(MLP_WEIGHTS) else self.block
                    self.grids[name] = rtn_grid(w, self.bits, block)
        release_freed()  # the layer's float weights and calibration temporaries

    def _loaded(self, module, prefix: str, skip: str | None = None):
        """A context in which `module`'s parameters hold the source's weights (those under `skip` left
        out), put back on the meta device after it."""
        import contextlib

        import torch
        from accelerate.utils import set_module_tensor_to_device

        names = [n for n, _ in module.named_parameters() if not (skip and n.startswith(skip))]

        @contextlib.contextmanager
        def loaded():
            try:
                for n in names:
                    # owned and writable: AWQ folds its scales into the weights in place, and a GGUF's F32
                    # tensors come as read-only views of the file's map (writing one was a segfault)
                    value = self.tensors.float(prefix + n)
                    value = torch.from_numpy(value if value.flags.writeable else value.copy())
                    set_module_tensor_to_device(module, n, "cpu", value=value)
                yield
            finally:
                for n in names:
                    set_module_tensor_to_device(module, n, "meta")
        return loaded()
