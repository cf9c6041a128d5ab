"""The LoRA graph's adapter path: each target's output plus ((x A^T) * w) B, per layer.

A and B of every adapter a step may use sit side by side in "adapter columns" (runtime.contract), one
input pair per layer and target, and w (lora_weights) weighs each token's columns: one-hot per token
for a batch of different adapters, a mixture for X-LoRA. Two GEMMs and a Mul per target, reading only
the columns the runtime binds, and no per-layer gather of stacked weights. A row of w holds one set of
weights for all targets or one per target and layer (layerwise X-LoRA); each target gathers its set,
min(its module index, sets - 1), so one graph serves both.
"""

from __future__ import annotations

import numpy as np

from exporter.builders.onnx_builder import FLOAT, GraphBuilder
from exporter.builders.spec import DecoderSpec, LoraSlots, proj_features
from runtime import contract as C


class LoraPath:
    def __init__(self, b: GraphBuilder, spec: DecoderSpec, slots: LoraSlots | None, scales=None) -> None:
        """scales (an awq.LoraScales) undoes, on this path only, the AWQ scales folded into the weights."""
        self.b, self.scales = b, scales
        self.enabled = slots is not None
        self.inputs: dict[tuple[int, str], tuple[str, str]] = {}
        self._unscaled: dict[tuple[int, str], str] = {}  # (layer, input) -> the input times its AWQ scale
        if slots is None:
            return
        features = proj_features(spec)
        weights = b.input(C.LORA_WEIGHTS, FLOAT, ["num_tokens", "lora_weight_columns"])
        for layer in range(spec.num_layers):
            for t in slots.targets:
                fin, fout = features[t]
                self.inputs[layer, t] = (b.input(C.lora_a(layer, t), FLOAT, ["lora_columns", fin]),
                                         b.input(C.lora_b(layer, t), FLOAT, ["lora_columns", fout]))
        self._sets(weights, self.inputs[0, slots.targets[0]][0])

    def _sets(self, weights: str, some_a: str) -> None:
        """w as [tokens, sets, columns] and the last set's index (a graph without adapter columns bound
        still gets one set)."""
        b = self.b
        one = b.const([1])
        shape = b.op("Shape", [weights])
        cols = b.op("Shape", [some_a], start=0, end=1)
        sets = b.op("Max", [b.op("Div", [b.op("Slice", [shape, one, b.const([2])]), b.op("Max", [cols, one])]), one])
        self.sets = b.op("Reshape", [weights, b.op("Concat", [b.op("Slice", [shape, b.const([0]), one]), sets, cols],
                                                   axis=0)])
        self.last_set = b.op("Sub", [b.op("Squeeze", [sets, b.const([0])]), b.const(1)])

    def mix(self, layer: int, target: str) -> str:
        """[tokens, columns]: the target's set of weights."""
        module = C.lora_module(layer, target)
        index = self.b.op("Min", [self.b.weight(f"lora_module.{module}", np.array(module, np.int64)), self.last_set])
        return self.b.op("Gather", [self.sets, index], axis=1)

    def _input(self, layer: int, target: str, x: str) -> str:
        s = self.scales.inputs.get((layer, target)) if self.scales else None
        if s is None:
            return x
        if (layer, x) not in self._unscaled:  # q/k/v (gate/up) share their input and its scale
            self._unscaled[layer, x] = self.b.op("Mul", [x, self.b.weight(f"layers.{layer}.{target}.lora_input_scale",
                                                                          s.astype(np.float32))])
        return self._unscaled[layer, x]

    def apply(self, layer: int, target: str, x: str, y: str) -> str:
        """y, the target's output on input x, plus the adapters' weighted delta (y alone without LoRA)."""
        if (layer, target) not in self.inputs:
            return y
        b = self.b
        a, b_in = self.inputs[layer, target]
        xa = b.op("Gemm", [self._input(layer, target, x), a], transB=1)  # [N, columns]
        delta = b.op("MatMul", [b.op("Mul", [xa, self.mix(layer, target)]), b_in])  # [N, out]
        s_out = self.scales.outputs.get((layer, target)) if self.scales else None
        if s_out is not None:  # the base output was divided by the next group's scale: so is the delta
            delta = b.op("Mul", [delta, b.weight(f"layers.{layer}.{target}.lora_output_scale",
                                                 (1.0 / s_out).astype(np.float32))])
        return b.op("Add", [y, delta])
