"""The LoRA graph's adapter path: per-token mixing weights over stacked A and B per target.

Each target projection's output gets sum_a w[token, a] * (x A_a) B_a added, with the adapter scale
folded into B; slot 0 of the adapter dimension is "no adapter" for the runtime to leave at zero.
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
        self.inputs: dict[str, tuple[str, str]] = {}
        self.mix = None
        self._unscaled: dict[tuple[int, str], str] = {}  # (layer, input) -> the input times its AWQ scale
        if slots is None:
            return
        features, nl = proj_features(spec), spec.num_layers
        weights = b.input(C.LORA_WEIGHTS, FLOAT, ["num_tokens", "num_adapters"])
        for t in slots.targets:
            fin, fout = features[t]
            self.inputs[t] = (b.input(C.lora_a(t), FLOAT, [nl, "num_adapters", fin, "rank"]),
                              b.input(C.lora_b(t), FLOAT, [nl, "num_adapters", "rank", fout]))
        # [num_adapters, num_tokens, 1]: per-token mixing weight of each adapter
        self.mix = b.op("Unsqueeze", [b.op("Transpose", [weights], perm=[1, 0]), b.const([2])])

    def _input(self, layer: int, target: str, x: str) -> str:
        s = self.scales.inputs.get((layer, target)) if self.scales else None
        if s is None:
            return x
        if (layer, x) not in self._unscaled:  # q/k/v (gate/up) share their input and its scale
            self._unscaled[layer, x] = self.b.op("Mul", [x, self.b.weight(f"layers.{layer}.{target}.lora_input_scale",
                                                                          s.astype(np.float32))])
        return self._unscaled[layer, x]

    def apply(self, layer: int, target: str, x: str, y: str) -> str:
        """y, the target's output on input x, plus the adapters' mixed delta (y alone without LoRA)."""
        if target not in self.inputs:
            return y
        b = self.b
        a_all, b_all = self.inputs[target]
        a_l = b.op("Gather", [a_all, b.const(layer)], axis=0)  # [A, in, r]
        b_l = b.op("Gather", [b_all, b.const(layer)], axis=0)  # [A, r, out]
        xb = b.op("MatMul", [b.op("MatMul", [self._input(layer, target, x), a_l]), b_l])  # [A, N, out]
        delta = b.op("ReduceSum", [b.op("Mul", [xb, self.mix]), b.const([0])], keepdims=0)  # [N, out]
        s_out = self.scales.outputs.get((layer, target)) if self.scales else None
        if s_out is not None:  # the base output was divided by the next group's scale: so is the delta
            delta = b.op("Mul", [delta, b.weight(f"layers.{layer}.{target}.lora_output_scale",
                                                 (1.0 / s_out).astype(np.float32))])
        return b.op("Add", [y, delta])
