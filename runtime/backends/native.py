"""The native backend: onnxruntime + numpy. The only module here that touches an ONNX Runtime API.

The KV pool is one numpy array per layer and kind, bound to the session as an OrtValue that
shares its memory, so writing this step's K/V into blocks is a numpy scatter of num_tokens rows
and nothing is copied per step. Block tables live here too, updated a block at a time.
"""

from __future__ import annotations

import os

import numpy as np

from runtime import contract as C
from runtime.errors import DeviceError, PackageError
from runtime.kv_blocks import kv_bytes_per_token
from runtime.package import ModelPackage
from runtime.step_batch import StepBatch, StepResult

STEP_DTYPES = {name: np.dtype(dtype) for name, dtype in C.STEP_INPUT_DTYPES.items()}

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
        for key, value in package.session_config.items():  # e.g. the browser format's QDQ switch
            opts.add_session_config_entry(key, str(value))
        self._ort = ort
        graph = package.graph_path
        if lora:
            if package.lora_graph_path is None:
                raise PackageError(f"{package.path}: this package was exported without the LoRA graph")
            graph = package.lora_graph_path
        self.matmul_kernel = "onnxruntime's own"  # what runs the 4-bit projections; _kernel_session may say more
        self.attention_kernel = "the graph's own"  # the exported gather + attention, or ruvllm.PagedAttention
        self.session = self._kernel_session(graph, opts) if self.providers == DEVICE_PROVIDERS["cpu"] else None
        if self.session is None:
            try:
                self.session = ort.InferenceSession(str(graph), sess_options=opts, providers=self.providers)
            except Exception as err:  # onnxruntime raises its own exception types
                raise PackageError(f"{package.path}: onnxruntime cannot load {graph.name}: "
                                   f"{str(err).splitlines()[0][:300]}") from err
        names = [i.name for i in self.session.get_inputs()]
        from runtime.package import expected_inputs

        contract = expected_inputs(self.num_layers, lora=lora)
        if names[:len(contract)] != contract or (not lora and len(names) != len(contract)):
            raise PackageError(f"{package.path}: the graph's inputs do not match its manifest")
        self.block_tables: np.ndarray | None = None

    def _kernel_session(self, graph, opts):
        """The graph on RuvLLM's CPU kernels (runtime/backends/cpu_kernels.py), or None to run it as it is;
        `self.matmul_kernel` and `self.attention_kernel` say which and why."""
        from runtime.backends import cpu_kernels

        self.matmul_kernel = "onnxruntime MatMulNBits"
        lib, why = cpu_kernels.library()
        if lib is None:
            self.matmul_kernel += f" ({why})"
            self.attention_kernel += f" ({why})"
            return None
        try:
            ops = cpu_kernels.operators(lib)
            model, count, layers = cpu_kernels.rewrite_graph(graph, self.pkg.config, ops)
        except Exception as err:  # a graph onnx cannot parse: the plain load below reports it
            self.matmul_kernel += f" (graph not rewritten: {str(err)[:200]})"
            return None
        if not count:
            self.matmul_kernel += " (no 4-bit MatMulNBits here that ruvllm.MatMulQ4 computes)"
        if not count and not layers:
            return None
        opts.register_custom_ops_library(str(lib))
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(graph.parent))
        try:
            session = self._ort.InferenceSession(model, sess_options=opts, providers=self.providers)
        except Exception as err:
            why = f" (RuvLLM's kernels failed to load: {str(err).splitlines()[0][:200]})"
            self.matmul_kernel += why
            self.attention_kernel += why
            return None
        if count:
            isa = "AVX-512 VNNI" if "PagedAttention" in ops else "AVX2"
            self.matmul_kernel = f"ruvllm.MatMulQ4 ({count} of the graph's MatMulNBits, {isa})"
        self.attention_kernel = (f"ruvllm.PagedAttention ({layers} layers)" if layers else
                                 "the graph's own" + ("" if "PagedAttention" in ops else " (AVX2 build: no PagedAttention)"))
        return session

    def allocate(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int) -> None:
        shape = (self.num_layers, self.kv_heads, num_blocks, block_size, self.head_dim)
        # np.zeros would map pages lazily and each first write would fault (~1.7 ms/step on SmolLM2):
        # commit the pool up front, as a server reserves its KV memory. One array per kind; each layer's
        # graph input is a contiguous view of it, so a step's K/V are written with one assignment.
        self.k_pool, self.v_pool = np.empty(shape, np.float32), np.empty(shape, np.float32)
        self.k_pool.fill(0.0)
        self.v_pool.fill(0.0)
        flat = (self.num_layers, self.kv_heads, num_blocks * block_size, self.head_dim)  # [layer, head, slot, dim]
        self._k_flat, self._v_flat = self.k_pool.reshape(flat), self.v_pool.reshape(flat)
        self.block_tables = np.zeros((max_seqs, max_blocks_per_seq), np.int64)
        # one binding for the session's life: the pools are bound once, as OrtValues sharing their memory
        self._io = self.session.io_binding()
        for i in range(self.num_layers):
            self._io.bind_ortvalue_input(C.past_key(i), self._ort.OrtValue.ortvalue_from_numpy(self.k_pool[i]))
            self._io.bind_ortvalue_input(C.past_value(i), self._ort.OrtValue.ortvalue_from_numpy(self.v_pool[i]))
        self._bound: tuple | None = None  # the output shapes currently bound
        self._bound_inputs: dict[str, tuple] = {}  # input name -> (the values it is bound to, their array)
        self._table_version = 0
        self._outputs: dict[str, np.ndarray] = {}

    def _bind_outputs(self, num_tokens: int, rows: int, top_k: int, want_logits: bool) -> dict[str, np.ndarray]:
        """Bind every output to a preallocated array; a step shaped like the last one rebinds nothing."""
        key = (num_tokens, rows, top_k, want_logits)
        if key == self._bound:
            return self._outputs
        io = self._io
        io.clear_binding_outputs()
        shape = (self.num_layers, num_tokens, self.kv_heads, self.head_dim)
        outs = {C.PRESENT_KEY: np.empty(shape, np.float32), C.PRESENT_VALUE: np.empty(shape, np.float32)}
        if rows:
            outs[C.TOPK_LOGPROBS] = np.empty((rows, top_k), np.float32)
            outs[C.TOPK_IDS] = np.empty((rows, top_k), np.int64)
            if want_logits:
                outs[C.LOGITS] = np.empty((rows, self.vocab_size), np.float32)
        for name, buf in outs.items():
            io.bind_output(name, "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)
        self._bound, self._outputs = key, outs
        return outs

    kv_bytes_per_token = staticmethod(kv_bytes_per_token)

    def set_block(self, slot: int, index: int, block: int) -> None:
        self.block_tables[slot, index] = block
        self._table_version += 1

    def _bind(self, name: str, key, make) -> None:
        """Bind make(key) to a graph input unless the same key is bound already. The array is kept:
        onnxruntime may read it in place at every run it stays bound for."""
        bound = self._bound_inputs.get(name)
        if bound is None or bound[0] != key:
            arr = make(key)
            self._io.bind_cpu_input(name, arr)
            self._bound_inputs[name] = (key, arr)

    def run(self, batch: StepBatch, extra_inputs: dict | None = None) -> StepResult:
        """Run one step; extra_inputs binds further graph inputs (the LoRA graph's adapter tensors)."""
        io = self._io
        rows = len(batch.logits_index)
        top_k = min(batch.top_k, self.vocab_size)
        # a decode step repeats most inputs of the last one (sampling settings, padding, indices):
        # rebinding only what changed saves ~10 array conversions and bindings per step
        table_key = (tuple(batch.slots), batch.max_blocks, self._table_version)
        self._bind(C.BLOCK_TABLES, table_key, lambda _: self.block_tables[batch.slots, :batch.max_blocks])
        for name, (values, dims) in batch.feeds(None, top_k).items():
            self._bind(name, (values, dims), lambda key, t=STEP_DTYPES[name]: np.array(key[0], t).reshape(key[1]))
        for name, arr in (extra_inputs or {}).items():
            io.bind_cpu_input(name, arr)
            self._bound_inputs[name] = (object(), arr)  # never equal: rebound whenever given
        outs = self._bind_outputs(len(batch.input_ids), rows, top_k, batch.want_full_logits)
        self.session.run_with_iobinding(io)
        first, n = batch.kv_slots[0], len(batch.kv_slots)
        if batch.kv_slots[-1] - first == n - 1 and batch.kv_slots == list(range(first, first + n)):
            slots = slice(first, first + n)  # one run of slots (every decode, most chunks): no fancy indexing
        else:
            slots = np.array(batch.kv_slots, np.int64)
        self._k_flat[:, :, slots] = outs[C.PRESENT_KEY].transpose(0, 2, 1, 3)
        self._v_flat[:, :, slots] = outs[C.PRESENT_VALUE].transpose(0, 2, 1, 3)
        if not rows:
            return StepResult([], [])
        logits = outs[C.LOGITS].copy() if batch.want_full_logits else None
        return StepResult(outs[C.TOPK_IDS].tolist(), outs[C.TOPK_LOGPROBS].tolist(), logits)
