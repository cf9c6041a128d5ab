"""A package's weights as dense fp32 matrices, whatever form the graph stores them in, for the instant
loop's numpy decoder (lora_gradients.DenseDecoder; native only).

The served weights are what a user's adapter must be learned against, so they are read back from the
package rather than from a source: an fp32 MatMul's initializer as it is, a MatMulNBits grid as
(q - zero) * scale (plus its blocks' minimums, the `{w}/add_mins` Gemm beside it), a GGUF block type at
its own bits (ruvllm.MatMulQ4 / MatMulQ8, one operator per run of a type) as gguf dequantizes it, and an
embedding table in any of the three (a float table, a grid's `.q`/`.scales`, ruvllm.GatherQ).

Dense fp32 is 4 bytes a weight, so nothing here keeps a matrix: `DenseCache` (lora_gradients) decides
what stays, under a byte budget, and the rest is read again from the mapped file when it is needed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.backends.block_layouts import BY_KIND, DOMAIN, OWN, dequantize_node, own_grid, unpack_4bit
from runtime.errors import PackageError

MATMULS = ("MatMul", "MatMulNBits", "MatMulQ4", "MatMulQ8")


class GraphWeights:
    """The matrices of one decoder graph, by the weight names the exporter gives them (`layers.3.qkv_proj`,
    `lm_head`), each as [in, out] fp32; read lazily from the graph's external data."""

    def __init__(self, graph: Path) -> None:
        import onnx

        model = onnx.load(str(graph), load_external_data=False)
        self.base = graph.parent
        self.inits = {t.name: t for t in model.graph.initializer}
        self.consumers: dict[str, list] = {}
        for node in model.graph.node:
            for x in node.input:
                self.consumers.setdefault(x, []).append(node)
        self.parts: dict[str, list] = {}  # weight -> the operators computing x . W, in output-column order
        self.gather_q = None
        self._own_table = None
        for node in model.graph.node:
            if node.domain == DOMAIN and node.op_type == "GatherQ" and node.input[0].startswith("model.embed_tokens"):
                self.gather_q = node
            if node.op_type not in MATMULS or len(node.input) < 2:
                continue
            w = self._weight_of(node)
            if w is not None:
                self.parts.setdefault(w, []).append(node)

    def _weight_of(self, node) -> str | None:
        name = node.input[1]
        if node.op_type == "MatMul":
            t = self.inits.get(name)
            return name if t is not None and t.data_type == 1 and len(t.dims) == 2 else None
        # MatMulNBits `{w}_Q4` / `{w}_Q8`; ruvllm.MatMulQ4/Q8 at a GGUF type's bits `{w}_{TYPE}` or `{w}_part{i}_{TYPE}`
        stem = name.rsplit("_Q", 1)[0]
        head, _, tail = stem.rpartition("_part")
        return head if head and tail.isdigit() else stem

    def array(self, name: str) -> np.ndarray:
        """An initializer; external data is mapped, not read (a table's rows cost only their pages)."""
        import onnx
        from onnx import numpy_helper

        t = self.inits[name]
        if t.data_location != onnx.TensorProto.EXTERNAL:
            return numpy_helper.to_array(t)
        info = {e.key: e.value for e in t.external_data}
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        return np.memmap(self.base / info["location"], dtype=np.uint8, mode="r", offset=int(info.get("offset", 0)),
                         shape=(int(info["length"]),)).view(dtype).reshape(tuple(t.dims))

    def embedding_vocab(self) -> int:
        for name in ("model.embed_tokens.weight", "model.embed_tokens.q"):
            if name in self.inits:
                return int(self.inits[name].dims[0])
        if self.gather_q is not None:
            return next(a.i for a in self.gather_q.attribute if a.name == "N")
        raise PackageError("the graph's embedding table is in a form the instant loop does not read")

    def __contains__(self, w: str) -> bool:
        return w in self.parts

    def matrix(self, w: str) -> np.ndarray:
        """W [in, out] in fp32, as the graph multiplies by it."""
        nodes = self.parts.get(w)
        if not nodes:
            raise PackageError(f"the graph has no projection named {w!r}")
        cols = [self._dense(w, node) for node in nodes]
        return cols[0] if len(cols) == 1 else np.concatenate(cols, axis=1)

    def _dense(self, w: str, node) -> np.ndarray:
        attrs = {a.name: a.i for a in node.attribute}
        if node.op_type == "MatMul":
            return self.array(node.input[1]).astype(np.float32, copy=False)
        if node.op_type == "MatMulNBits":
            return self._nbits(w, node, attrs)
        if node.domain == DOMAIN and attrs.get("kquant"):
            return np.ascontiguousarray(dequantize_node(attrs, self.array(node.input[1])).T)
        raise PackageError(f"{node.name}: the instant loop does not read a {node.op_type} weight "
                           "(its layout is the kernels' own, written at load)")

    def _nbits(self, w: str, node, attrs: dict) -> np.ndarray:
        n, k, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
        blocks = -(-k // block)
        packed = self.array(node.input[1]).reshape(n, blocks, -1)
        scales = self.array(node.input[2]).astype(np.float32).reshape(n, blocks)
        if bits == 4:
            q = unpack_4bit(packed, blocks * block).reshape(n, blocks, block)
        elif bits == 8:
            q = packed
        else:
            raise PackageError(f"{node.name}: MatMulNBits of {bits} bits is not read here")
        if len(node.input) > 3 and node.input[3]:
            zp = self.array(node.input[3])
            if zp.dtype != np.uint8:
                raise PackageError(f"{node.name}: float zero points are not read here")
            zp = unpack_4bit(zp.reshape(n, -1), blocks) if bits == 4 else zp.reshape(n, -1)
            zero = zp[:, :blocks].astype(np.float32)
        else:
            zero = np.full((n, blocks), 2 ** (bits - 1), np.float32)
        dense = (q.astype(np.float32) - zero[..., None]) * scales[..., None]
        mins = next((m for m in (f"{w}_mins", f"{w}_mins_fp16") if m in self.inits), None)
        if mins is not None:  # the `{w}/add_mins` Gemm: [blocks, N], one per block of activations
            dense += self.array(mins).astype(np.float32).T[..., None]
        return np.ascontiguousarray(dense.reshape(n, blocks * block)[:, :k].T)

    # ---- the embedding table's rows ----

    def embedding_rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of the input embedding for token ids, fp32 (the graph's own dequantization)."""
        if "model.embed_tokens.weight" in self.inits:
            return self.array("model.embed_tokens.weight")[ids].astype(np.float32)
        if self.gather_q is not None:
            attrs = {a.name: a.i for a in self.gather_q.attribute}
            kind, n, k = BY_KIND[attrs["kquant"]], attrs["N"], attrs["K"]
            if self._own_table is None:  # q at a byte a weight and the blocks' scales: not dense
                self._own_table = own_grid(kind, self.array(self.gather_q.input[0]), n, k)
            q, scale, zero, mins = self._own_table
            t = OWN[kind]
            qb = q[ids].reshape(len(ids), -1, t.block).astype(np.float32)
            s = scale[ids][..., None]
            rows = (qb - zero[ids][..., None]) * s if zero is not None else qb * s + mins[ids][..., None]
            return rows.reshape(len(ids), k)
        if "model.embed_tokens.q" in self.inits:
            q = self.array("model.embed_tokens.q")[ids].astype(np.float32)
            scale = self.array("model.embed_tokens.scales")[ids]
            nblk = scale.shape[1]
            qb = q.reshape(len(ids), nblk, -1)
            if "model.embed_tokens.zero_points" in self.inits:
                zero = self.array("model.embed_tokens.zero_points")[ids].astype(np.float32)[..., None]
            else:
                zero = self._uniform_zero()
            rows = (qb - zero) * scale[..., None]
            if "model.embed_tokens.mins" in self.inits:
                rows += self.array("model.embed_tokens.mins")[ids][..., None]
            return rows.reshape(len(ids), -1)
        raise PackageError("the graph's embedding table is in a form the instant loop does not read")

    def _uniform_zero(self) -> float:
        """A gridded table's one zero point: the constant its Sub takes (embedding.grid_rows: Gather the
        `.q` rows, Cast, Reshape, Sub)."""
        x = "model.embed_tokens.q"
        for _ in range(4):
            node = next((n for n in self.consumers.get(x, ()) if n.op_type in ("Gather", "Cast", "Reshape", "Sub")), None)
            if node is None:
                break
            if node.op_type == "Sub":
                return float(self.array(node.input[1]))
            x = node.output[0]
        raise PackageError("a gridded embedding table without its zero point")
