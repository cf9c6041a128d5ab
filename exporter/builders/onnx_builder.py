"""A small helper for writing ONNX graphs node by node, with unique names and cached constants."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 24  # TensorScatter (KV written in place into the gathered context) is opset 24
IR_VERSION = 11  # onnxruntime 1.31 and onnxruntime-web 1.30 read IR 11 with opset 24
MS_DOMAIN = "com.microsoft"


class GraphBuilder:
    """Accumulates nodes, initializers and I/O; names every intermediate value uniquely. With a
    `store` (writers.external_data.WeightStore), large weights go to the package's data file as they
    are added and the graph holds references."""

    def __init__(self, name: str, store=None) -> None:
        self.name, self.store = name, store
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._count = 0
        self._consts: dict[tuple, str] = {}

    def _fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list) -> None:
        """Declare a graph output; the node producing it must write to this exact name (op(..., out=name))."""
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def annotate(self, name: str, elem_type: int, shape: list) -> str:
        """Declare an intermediate value's shape. Symbolic dims shared by two values tell onnxruntime's
        memory planner they have the same size, which an in-place kernel needs to reuse its input."""
        self.value_info.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        if self.store is not None:
            self.initializers.append(self.store.tensor(name, array))
        else:  # np.ascontiguousarray would turn a 0-d scalar into shape [1]
            self.initializers.append(numpy_helper.from_array(np.require(array, requirements="C"), name))
        return name

    def named_weight(self, name: str, make) -> str:
        """A weight made by `make()` only if no graph built on the same store has made it (the base and
        LoRA graphs share every weight by name)."""
        if self.store is not None:
            self.initializers.append(self.store.named(name, make))
            return name
        return self.weight(name, make())

    def const(self, values, dtype=np.int64) -> str:
        arr = np.asarray(values, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(self._fresh("const"), arr)
        return self._consts[key]

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, name: str | None = None,
           out: str | list[str] | None = None, domain: str | None = None, **attrs):
        node_name = name or self._fresh(op_type)
        if out is None:
            outs = [f"{node_name}/out{i}" for i in range(n_out)]
        else:
            outs = [out] if isinstance(out, str) else list(out)
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=node_name, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers,
                                  value_info=self.value_info)
        opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
        return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name="ruvllm-exporter")


def replace_graph(model: onnx.ModelProto, nodes: list, initializers: list) -> onnx.ModelProto:
    """`model` with its nodes and initializers replaced (a rewrite's result), in place."""
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    model.graph.ClearField("initializer")
    model.graph.initializer.extend(initializers)
    return model


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
