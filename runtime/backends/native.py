"""The native backend: onnxruntime + numpy. The only module here that touches an ONNX Runtime API.

The KV pool is one numpy array per layer and kind, bound to the session as an OrtValue that
shares its memory, so writing this step's K/V into blocks is a numpy scatter of num_tokens rows
and nothing is copied per step. Block tables live here too, updated a block at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from runtime import contract as C
from runtime.errors import DeviceError, PackageError
from runtime.package import ModelPackage
from runtime.step_batch import StepBatch

DEVICE_PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "coreml": ["CoreMLExecutionProvider", "CPUExecutionProvider"],
}


def providers_for(device: str) -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device == "auto":
        for name in ("cuda", "coreml"):
            if DEVICE_PROVIDERS[name][0] in available:
                return DEVICE_PROVIDERS[name]
        return DEVICE_PROVIDERS["cpu"]
    if device not in DEVICE_PROVIDERS:
        raise DeviceError(f"unknown device {device!r}; choose cpu, cuda, coreml or auto")
    wanted = DEVICE_PROVIDERS[device][0]
    if wanted not in available:
        raise DeviceError(f"device {device!r} needs {wanted}, which this onnxruntime does not have "
                          f"(available: {', '.join(available)})")
    return DEVICE_PROVIDERS[device]


@dataclass
class StepResult:
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    logits: object | None = None  # numpy [num_logits, vocab] when asked for


class NativeBackend:
    name = "onnxruntime"

    def __init__(self, package: ModelPackage, device: str = "cpu", threads: int | None = None,
                 lora: bool = False) -> None:
        import onnxruntime as ort

        self.pkg = package
        cfg = package.config
        self.num_layers = cfg["num_layers"]
        self.kv_heads = cfg["num_kv_heads"]
        self.head_dim = cfg["head_dim"]
        self.vocab_size = cfg["vocab_size"]
        self.providers = providers_for(device)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads or int(os.environ.get("RUVLLM_THREADS", 0)) or (os.cpu_count() or 1)
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self._ort = ort
        graph = package.graph_path
        if lora:
            if package.lora_graph_path is None:
                raise PackageError(f"{package.path}: this package was exported without the LoRA graph")
            graph = package.lora_graph_path
        self.lora = lora
        try:
            self.session = ort.InferenceSession(str(graph), sess_options=opts, providers=self.providers)
        except Exception as err:  # onnxruntime raises its own exception types
            raise PackageError(f"{package.path}: onnxruntime cannot load {package.graph_path.name}: "
                               f"{str(err).splitlines()[0][:300]}") from err
        names = [i.name for i in self.session.get_inputs()]
        from runtime.package import expected_inputs

        contract = expected_inputs(self.num_layers, lora=lora)
        if names[:len(contract)] != contract or (not lora and len(names) != len(contract)):
            raise PackageError(f"{package.path}: the graph's inputs do not match its manifest")
        self.pools: list[tuple[np.ndarray, np.ndarray]] = []
        self.block_tables: np.ndarray | None = None

    def allocate(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int) -> None:
        shape = (num_blocks, block_size, self.kv_heads, self.head_dim)
        self.block_size = block_size
        self.pools = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(self.num_layers)]
        self._flat = [(k.reshape(-1, self.kv_heads, self.head_dim), v.reshape(-1, self.kv_heads, self.head_dim))
                      for k, v in self.pools]
        self.block_tables = np.zeros((max_seqs, max_blocks_per_seq), np.int64)
        self._pool_values = []
        for i, (k, v) in enumerate(self.pools):
            self._pool_values.append((C.past_key(i), self._ort.OrtValue.ortvalue_from_numpy(k)))
            self._pool_values.append((C.past_value(i), self._ort.OrtValue.ortvalue_from_numpy(v)))

    @staticmethod
    def kv_bytes_per_token(cfg: dict) -> int:
        return cfg["num_layers"] * 2 * cfg["num_kv_heads"] * cfg["head_dim"] * 4

    def set_block(self, slot: int, index: int, block: int) -> None:
        self.block_tables[slot, index] = block

    def run(self, batch: StepBatch, extra_inputs: dict | None = None) -> StepResult:
        """Run one step; extra_inputs binds further graph inputs (the LoRA graph's adapter tensors)."""
        io = self.session.io_binding()
        i64, f32 = np.int64, np.float32
        feeds = {
            C.INPUT_IDS: np.array(batch.input_ids, i64),
            C.POSITION_IDS: np.array(batch.position_ids, i64),
            C.QUERY_INDEX: np.array(batch.query_index, i64),
            C.FLAT_INDEX: np.array(batch.flat_index, i64),
            C.BLOCK_TABLES: np.ascontiguousarray(self.block_tables[batch.slots, :batch.max_blocks]),
            C.LOGITS_INDEX: np.array(batch.logits_index, i64),
            C.TEMPERATURE: np.array(batch.temperature, f32),
            C.REPETITION_PENALTY: np.array(batch.repetition_penalty, f32),
            C.PRESENCE_PENALTY: np.array(batch.presence_penalty, f32),
            C.FREQUENCY_PENALTY: np.array(batch.frequency_penalty, f32),
            C.SPARSE_IDS: np.array(batch.sparse_ids, i64).reshape(len(batch.logits_index), -1),
            C.SPARSE_SEEN: np.array(batch.sparse_seen, f32).reshape(len(batch.logits_index), -1),
            C.SPARSE_COUNTS: np.array(batch.sparse_counts, f32).reshape(len(batch.logits_index), -1),
            C.SPARSE_BIAS: np.array(batch.sparse_bias, f32).reshape(len(batch.logits_index), -1),
            C.TOP_K: np.array([min(batch.top_k, self.vocab_size)], i64),
        }
        feeds.update(extra_inputs or {})
        for name, arr in feeds.items():
            io.bind_cpu_input(name, arr)
        for name, value in self._pool_values:
            io.bind_ortvalue_input(name, value)
        out_names = []
        for i in range(self.num_layers):
            out_names += [C.present_key(i), C.present_value(i)]
        has_logits = bool(batch.logits_index)
        if has_logits:
            out_names += [C.TOPK_LOGPROBS, C.TOPK_IDS]
            if batch.want_full_logits:
                out_names.append(C.LOGITS)
        for name in out_names:
            io.bind_output(name)
        self.session.run_with_iobinding(io)
        outs = io.copy_outputs_to_cpu()
        slots = np.array(batch.kv_slots, i64)
        for i in range(self.num_layers):
            k_flat, v_flat = self._flat[i]
            k_flat[slots] = outs[2 * i]
            v_flat[slots] = outs[2 * i + 1]
        if not has_logits:
            return StepResult([], [])
        base = 2 * self.num_layers
        return StepResult(outs[base + 1].tolist(), outs[base].tolist(),
                          outs[base + 2] if batch.want_full_logits else None)
