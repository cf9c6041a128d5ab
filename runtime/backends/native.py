"""The native backend: onnxruntime + numpy. The only module here that touches an ONNX Runtime API.

The KV pool (kv_pool.py) lives on the execution provider's device and is bound once; a step's K/V
are scattered into their blocks there, and only the candidates come back to the host. Block tables arrive with each step's batch (the scheduler owns
them); an input equal to the last step's is not converted or bound again.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import numpy as np

from runtime import contract as C
from runtime.core.backend import BackendInfo
from runtime.core.kv_blocks import kv_bytes_per_token
from runtime.core.step_batch import StepBatch, StepResult
from runtime.errors import DeviceError, PackageError, RequestError
from runtime.package import ModelPackage

if TYPE_CHECKING:
    from runtime.backends.adapter_weights import AdapterTensors

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


def row_logprobs(logits, token_ids: list[int]) -> list[float]:
    """Each row's log-softmax at its token (-1: 0.0, a row that scores nothing), in float64: the model's own
    log-probability of a prompt's next token (prompt_logprobs)."""
    ids = np.asarray(token_ids, np.int64)
    rows = np.nonzero(ids >= 0)[0]
    out = [0.0] * len(token_ids)
    if rows.size:
        x = np.asarray(logits[rows], np.float64)
        top = x.max(axis=1)
        lse = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
        for r, v in zip(rows.tolist(), (x[np.arange(rows.size), ids[rows]] - lse).tolist()):
            out[r] = v
    return out

class NativeBackend:
    name = "onnxruntime"
    kv_exact_blocks = 1  # allocate: kv_tails.TAIL_BLOCKS on a two-tier pool

    def __init__(self, package: ModelPackage, device: str = "cpu", threads: int | None = None,
                 lora: bool = False, kv_device_writes: bool | None = None, kv_dtype: str = "fp32") -> None:
        """kv_device_writes: write K/V with the pool's device graph even on CPU (kv_pool.py; tests).
        kv_dtype: the KV pool's numbers, "fp32", "int8" or "int4" (rows quantized as written; read by
        ruvllm.PagedAttention, or (int8) by the graph's own attention rewritten for them; CPU only)."""
        import onnxruntime as ort

        if kv_dtype not in C.KV_DTYPES:
            raise DeviceError(f"--kv-dtype {kv_dtype!r}: choose one of {', '.join(C.KV_DTYPES)}")
        self.kv_dtype = kv_dtype
        self.pkg = package
        self.providers = providers_for(device)
        if kv_dtype != "fp32" and self.providers != DEVICE_PROVIDERS["cpu"]:
            raise DeviceError(f"--kv-dtype {kv_dtype} runs on the CPU only (the pool is host memory), not {device}")
        cfg = package.config
        if kv_dtype == "int4" and cfg["head_dim"] % 32:
            raise DeviceError(f"--kv-dtype int4 stores rows in groups of 32 numbers; this model's head_dim is "
                              f"{cfg['head_dim']}: use --kv-dtype int8")
        self.num_layers = cfg["num_layers"]
        self.kv_heads = cfg["num_kv_heads"]
        self.head_dim = cfg["head_dim"]
        self.vocab_size = cfg["vocab_size"]
        self._threads = threads or int(os.environ.get("RUVLLM_THREADS", 0)) or (os.cpu_count() or 1)
        self._ort = ort
        self.matmul_kernel = "onnxruntime's own"  # what runs the 4-bit projections; _kernel_session may say more
        self.attention_kernel = "the graph's own"  # the exported gather + attention, or ruvllm.PagedAttention
        self.lora_kernel: str | None = None  # what computes the LoRA graph's adapter deltas, when it is ours
        self.paged_attention_layers = 0  # layers whose attention is ruvllm.PagedAttention (_kernel_session)
        self.block_matmuls = 0  # 4-bit projections ruvllm.MatMulQ4 computes (_kernel_session)
        self._lora_mlps_unfused = False  # an adapter graph's MLPs on onnxruntime's operators (_kernel_session)
        self._lora_all_fused = False  # every target's delta on ruvllm's LoRA kernels (idle (layer, target) pairs bind no columns)
        self._guide = None  # structured output's llguidance tables, made on the first constrained request
        self._no_mask = None  # the [1, vocab] zeros bound as logits_mask while no row is constrained
        self.mask_seconds, self.mask_steps = 0.0, 0  # structured output's mask time (ruvllm bench reports it)
        self._classifiers: dict[str, object] = {}  # X-LoRA id -> its classifier, weights read once
        self._portable: dict = {}  # no kernels: the weights graph_rewrite.rewrite_graph made, shared by both graphs
        self._in_memory: list = []  # the OrtValues each session was handed (add_external_initializers)
        self.session = self._open(lora)
        self.runner = GraphRunner(self, self.session)
        self.lora_runner: GraphRunner | None = self.runner if lora else None
        self.adapters: AdapterTensors | None = None
        self.pool = None
        self._kv_device_writes = kv_device_writes

    @property
    def batch_invariance(self) -> str:
        """Why a row's numbers may depend on what else is in its step; "" where they do not (issue 50).

        RuvLLM's kernels compute a row alike in any batch (tests/runtime/test_batch_invariance.py); onnxruntime's
        own attention and projections make no such promise."""
        why = []
        if not self.paged_attention_layers:
            why.append("attention on onnxruntime's kernels")
        if not self.block_matmuls:
            why.append("projections on onnxruntime's kernels")
        if self._lora_mlps_unfused:
            why.append("adapters' MLPs on onnxruntime's elementwise operators (e.g. an AWQ package's scaled up "
                       "projections)")
        return "; ".join(why)

    @property
    def batch_invariant(self) -> bool:
        return not self.batch_invariance

    @property
    def pads_rows(self) -> bool:
        """The graph's own attention computes every row over the step's longest chunk (ruvllm.PagedAttention
        reads each row's own tokens)."""
        return not self.paged_attention_layers

    def info(self) -> BackendInfo:
        return BackendInfo(self.name, ",".join(self.providers), self.kv_dtype, self.kv_exact_blocks, self.pads_rows,
                           self.batch_invariance, self.matmul_kernel, self.attention_kernel, self.lora_kernel,
                           self.pool.committed_bytes if self.pool is not None else None, self.mask_seconds,
                           self.mask_steps)

    def _options(self):
        """Fresh session options per session (a custom-op library registers its domain once per options)."""
        ort = self._ort
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = self._threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        for key, value in self.pkg.session_config.items():  # e.g. the browser format's QDQ switch
            opts.add_session_config_entry(key, str(value))
        return opts

    def _open(self, lora: bool):
        """A session on the package's graph (or its LoRA graph), on RuvLLM's CPU kernels where they apply."""
        package, ort, opts = self.pkg, self._ort, self._options()
        entry = package.manifest["graphs"].get("decoder_lora" if lora else "decoder")
        if entry is None:
            raise PackageError(f"{package.path}: this package was exported without the LoRA graph")
        graph = package.file(entry["file"])
        cpu = self.providers == DEVICE_PROVIDERS["cpu"]
        session = self._kernel_session(graph, opts, entry.get("fusions")) if cpu else None
        if session is None:
            from runtime.backends import graph_rewrite

            # no kernels: layouts only they read become standard operators (graph_rewrite.fuse with no ops), and
            # an int8 pool is read by the graph's own attention (graph_rewrite.kv_in_int8_graph)
            opts, rewrite_failed = self._options(), ""
            try:
                model, _ = graph_rewrite.rewrite_graph(graph, self.pkg.config, frozenset(), kv_dtype=self.kv_dtype,
                                                      weights=self._portable)
            except Exception as err:  # a graph onnx cannot parse: onnxruntime's load below names the problem
                model = str(graph)
                self._portable.clear()
                rewrite_failed = (f" (its rewrite for a host without RuvLLM's kernels failed: "
                                  f"{type(err).__name__}: {str(err)[:200]})")
            if self._portable:  # a kernel layout's portable weights, too large for the graph: handed over in memory
                values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self._portable.values()]
                opts.add_external_initializers(list(self._portable), values)
                self._in_memory.append(values)  # the session reads their arrays in place: held as long as it
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(graph.parent))
            try:
                session = ort.InferenceSession(model, sess_options=opts, providers=self.providers)
            except Exception as err:  # onnxruntime raises its own exception types
                raise PackageError(f"{package.path}: onnxruntime cannot load {graph.name}: "
                                   f"{str(err).splitlines()[0][:300]}{rewrite_failed}") from err
        names = [i.name for i in session.get_inputs()]
        if self.kv_dtype != "fp32":
            self._check_quantized_pool(session)
        from runtime.package import expected_inputs

        contract = expected_inputs(self.num_layers, lora=lora)
        scales = C.kv_scale_inputs(self.num_layers)
        names = [n for n in names if n not in scales]  # a quantized pool's scales (graph_rewrite.kv_quantized)
        if names and names[-1] == C.LOGITS_MASK:  # a graph with structured output's mask input
            names = names[:-1]
        if names[:len(contract)] != contract or (not lora and len(names) != len(contract)):
            raise PackageError(f"{package.path}: the graph's inputs do not match its manifest")
        if lora and C.lora_a(0, C.LORA_TARGETS[0]) not in names:
            raise PackageError(f"{package.path}: its LoRA graph takes adapters stacked over layers, an earlier "
                               "layout this runtime no longer feeds; re-export the package")
        return session

    def _check_quantized_pool(self, session) -> None:
        """Every layer must read the quantized pool: on ruvllm.PagedAttention, or (int8) the graph's own
        attention rewritten for it; a graph of another shape cannot."""
        types = {i.name: i.type for i in session.get_inputs()}
        want = "tensor(uint8)" if self.kv_dtype == "int4" else "tensor(int8)"
        if any(types.get(C.past_key(i)) != want for i in range(self.num_layers)):
            where = ("an int4 pool is read by RuvLLM's PagedAttention kernel only (AVX-512 or AVX2), here "
                     f"{self.attention_kernel}" if self.kv_dtype == "int4" else "some layers' attention cannot read it")
            raise DeviceError(f"--kv-dtype {self.kv_dtype}: {self.pkg.path.name}'s graph cannot run on this pool "
                              f"({where}); run it with --kv-dtype fp32 or int8")

    def _kernel_session(self, graph, opts, declared: dict[str, int] | None):
        """The graph on RuvLLM's CPU kernels (kernel_library, graph_rewrite), or None to run it as it is;
        `self.matmul_kernel` and `self.attention_kernel` say which and why.

        `declared`: what the exporter found fusable in this graph (the manifest's graph entry). A fusion
        this host's kernels could run but that does not apply to the graph is an error, not a silent
        fallback to the slower path: the graph and this runtime disagree about its shape."""
        from runtime.backends import graph_rewrite, kernel_library

        self.matmul_kernel = "onnxruntime MatMulNBits"
        self.paged_attention_layers = self.block_matmuls = 0
        lib, why = kernel_library.library()
        if lib is None:
            self.matmul_kernel += f" ({why})"
            self.attention_kernel += f" ({why})"
            return None
        ops = kernel_library.operators(lib)
        if os.environ.get("RUVLLM_PAGED_ATTENTION", "1") == "0":
            ops -= {"PagedAttention"}
        try:
            # a quantized package's adapters in fp16: half the bytes each step's deltas read
            model, counts = graph_rewrite.rewrite_graph(graph, self.pkg.config, ops,
                                                       half_adapters=self.pkg.weights_quantized,
                                                       kv_dtype=self.kv_dtype,
                                                       kv_tails=os.environ.get("RUVLLM_KV_TAILS", "1") != "0")
        except Exception as err:  # a graph onnx cannot parse: the plain load below reports it
            self.matmul_kernel += f" (graph not rewritten: {str(err)[:200]})"
            return None
        missed = {op: (n, counts.get(op, 0)) for op, n in (declared or {}).items() if op in ops and counts.get(op, 0) < n}
        if missed:
            what = ", ".join(f"{op} {got} of {n}" for op, (n, got) in missed.items())
            raise PackageError(f"{self.pkg.path}: {graph.name} declares fusions this runtime could not apply ({what}): "
                               "the graph does not have the shape its manifest says; re-export it, or set "
                               "RUVLLM_CPU_KERNELS=0 to run it as exported")
        count, layers = counts["MatMulQ4"], counts["PagedAttention"]
        if not count:
            self.matmul_kernel += " (no 4-bit MatMulNBits here that ruvllm.MatMulQ4 computes)"
        if not any(counts.values()):
            return None
        self.lora_kernel = f"ruvllm.LoraDelta ({counts['LoraDelta']} targets)" if counts.get("LoraDelta") else None
        # an adapter graph whose MLPs keep onnxruntime's elementwise operators (an AWQ package's scaled up projections)
        self._lora_mlps_unfused = bool(counts.get("LoraDelta")) and counts.get("LoraSwiGLU", 0) < self.num_layers
        if counts.get("LoraDelta"):
            self._lora_all_fused = counts["LoraDelta"] == self.num_layers * len(C.LORA_TARGETS)
        if counts.get("LoraSwiGLU"):
            self.lora_kernel += f", {counts['LoraSwiGLU']} MLPs' gate and up with their SwiGLU (ruvllm.LoraSwiGLU)"
        if counts.get("LoraSplit"):
            self.lora_kernel += f", {counts['LoraSplit']} attentions' q, k and v (ruvllm.LoraSplit)"
        if counts.get("LoraDelta") and self.pkg.weights_quantized:
            self.lora_kernel += ", adapters in fp16"
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
            isa = kernel_library.isa(lib)
            self.matmul_kernel = f"ruvllm.MatMulQ4 ({count} of the graph's MatMulNBits, {isa})"
            if counts.get("MatMulQ8"):
                self.matmul_kernel += f" + ruvllm.MatMulQ8 ({counts['MatMulQ8']} 8-bit)"
        self.attention_kernel = f"ruvllm.PagedAttention ({layers} layers)" if layers else "the graph's own"
        self.paged_attention_layers, self.block_matmuls = layers, count
        return session

    @property
    def two_tier(self) -> bool:
        """Whether a quantized pool keeps exact tails here (ruvllm.PagedAttention reads it)."""
        return C.KV_TAIL_KEY in {i.name for i in self.session.get_inputs()}

    def allocate(self, num_blocks: int, block_size: int) -> None:
        from runtime.backends.kv_pool import DeviceKVPool

        tails = self.two_tier
        self.pool = DeviceKVPool(self._ort, self.providers, self.num_layers, self.kv_heads, self.head_dim,
                                 num_blocks, block_size, self._kv_device_writes, self.kv_dtype, tails)
        self.kv_exact_blocks = self.pool.tail_blocks if tails else 1
        self.runner.bind_pool(self.pool)
        if self.lora_runner is not None and self.lora_runner is not self.runner:
            self.lora_runner.bind_pool(self.pool)

    def kv_bytes_per_token(self, cfg: dict) -> int:
        """Bytes one token takes in the pool, over all layers: fp32 rows, or quantized rows and their scales."""
        return kv_bytes_per_token(cfg, self.kv_dtype)

    def kv_block_layout(self) -> dict:
        """What a block's saved bytes hold (read_kv_blocks): the pool's arrays in order and their size."""
        return {"arrays": self.pool.block_arrays, "block_bytes": self.pool.block_bytes}

    def read_kv_blocks(self, blocks: list[int]) -> list[bytes]:
        return self.pool.read_blocks(blocks)

    def write_kv_blocks(self, blocks: list[int], data: list[bytes]) -> None:
        self.pool.write_blocks(blocks, data)

    # ---- adapters ----
    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """Open the LoRA graph beside the base one (steps with no adapter stay on the base graph) and
        its stacked adapter inputs, max_loras slots after slot 0 (no adapter), rank max_rank."""
        from runtime.backends.adapter_weights import AdapterTensors

        if self.adapters is not None:
            return
        if self.lora_runner is None:
            self.lora_runner = GraphRunner(self, self._open(lora=True))
            if self.pool is not None:
                self.lora_runner.bind_pool(self.pool)
        adapter_inputs = C.adapter_inputs(self.num_layers)
        kinds = {i.type for i in self.lora_runner.session.get_inputs() if i.name in adapter_inputs}
        if len(kinds) != 1:  # graph_rewrite.adapters_in_half turns all of them or none
            raise PackageError(f"{self.pkg.path}: the LoRA graph's adapter inputs mix types {sorted(kinds)}")
        dtype = np.float16 if kinds == {"tensor(float16)"} else np.float32
        self.adapters = AdapterTensors(self.pkg.config, max_loras, max_rank, dtype=dtype)
        self._lora_columns = -1  # the adapter columns the LoRA session has bound

    def enable_xlora(self, max_loras: int, max_rank: int, xlora) -> None:
        """enable_lora, with the LoRA graph's hidden states (the scaling pass's output) checked."""
        from runtime.core.adapters import AdapterError

        self.enable_lora(max_loras, max_rank)
        if C.HIDDEN_STATES not in {o.name for o in self.lora_runner.session.get_outputs()}:
            raise AdapterError(f"{self.pkg.path}: its LoRA graph has no {C.HIDDEN_STATES} output, which X-LoRA's "
                               "classifier reads; re-export the package")

    def guide(self, tokenizer):
        """The structured-output guide for this package, made on first use: llguidance
        (runtime/backends/guidance.py), or the page's pure-Python one (runtime/core/token_guide.py) with
        RUVLLM_GUIDE=python or where llguidance is not installed; RequestError when this package's graph
        cannot enforce a constraint."""
        if self._guide is None:
            if not self.runner.has_mask:
                raise RequestError(f"{self.pkg.path.name}: this package's graph has no {C.LOGITS_MASK} input, "
                                   "which structured output needs; re-export it", "response_format")
            which = os.environ.get("RUVLLM_GUIDE", "llguidance")
            if which not in ("llguidance", "python"):
                raise RequestError(f"RUVLLM_GUIDE={which!r} is not 'llguidance' or 'python'", "response_format")
            Guide = None
            if which == "llguidance":
                try:
                    from runtime.backends.guidance import Guide
                except ImportError:  # not installed: the pure-Python guide
                    pass
            eos = self.pkg.eos_token_ids
            if Guide is None:
                from runtime.core.token_guide import PyGuide

                self._guide = PyGuide.from_tokenizer(tokenizer, self.vocab_size, eos)
            else:
                meta = self.pkg.manifest["tokenizer"]
                self._guide = Guide(self.pkg.file(meta["file"]).read_text(encoding="utf-8"), self.vocab_size, eos)
        return self._guide

    def set_adapter(self, slot: int, info) -> None:
        """Put an adapter's weights (a runtime.core.adapters.AdapterInfo) into a slot of the LoRA inputs."""
        self.adapters.put(slot, info)

    def run(self, batch: StepBatch, extra_inputs: dict | None = None) -> StepResult:
        """Run one step; a batch with adapter slots runs on the LoRA graph. extra_inputs binds further
        graph inputs (tests drive the LoRA graph's adapter tensors directly with it)."""
        runner = self.runner
        if batch.dropped_blocks and self.pool is not None:
            self.pool.drop(batch.dropped_blocks)
        if batch.adapter_slots is not None:
            if self.adapters is None:
                raise RuntimeError("a step names adapter slots, but no adapter was enabled (enable_lora)")
            runner = self.lora_runner
            columns = self._bind_columns(batch.lora_slots())
            mix = self._xlora_pass(batch.xlora, columns) if batch.xlora else None
            weights = self.adapters.mixing(batch.adapter_slots, columns, mix)
            extra_inputs = {**(extra_inputs or {}), C.LORA_WEIGHTS: weights}
        if runner.has_mask and (batch.matchers is not None or runner.masked):
            extra_inputs = {**(extra_inputs or {}), C.LOGITS_MASK: self._logits_mask(batch)}
            runner.masked = batch.matchers is not None
        self._ensure_pool(batch)
        outs = runner.run(batch, extra_inputs)
        self.pool.write(outs[C.PRESENT_KEY], outs[C.PRESENT_VALUE], batch.kv_slots, batch)
        if not batch.logits_index:
            return StepResult([], [])
        logits = outs[C.LOGITS].copy() if batch.want_full_logits else None
        scores = None if batch.score_ids is None else row_logprobs(outs[C.LOGITS], batch.score_ids)
        return StepResult(outs[C.TOPK_IDS].tolist(), outs[C.TOPK_LOGPROBS].tolist(), logits, scores)

    async def run_async(self, batch: StepBatch) -> StepResult:
        return self.run(batch)

    def _ensure_pool(self, batch: StepBatch) -> None:
        """Commit the KV pool's memory up to the highest block this step writes (every block a step reads
        was written by an earlier one)."""
        if batch.kv_slots:
            self.pool.ensure(max(batch.kv_slots) // self.pool.block_size + 1)

    def _logits_mask(self, batch: StepBatch) -> np.ndarray:
        """[rows, vocab]: each constrained row's allowed tokens 0, the rest -inf; other rows 0. A step
        after a constrained one binds the [1, vocab] zeros back (a binding outlives its step)."""
        if batch.matchers is None:
            return self.no_mask()
        started = time.perf_counter()
        mask = np.zeros((len(batch.matchers), self.vocab_size), np.float32)
        for row, matcher in zip(mask, batch.matchers):
            if matcher is not None:
                allowed = np.unpackbits(np.frombuffer(matcher.allowed_bits(), np.uint8), bitorder="little")
                row[allowed[:self.vocab_size] == 0] = -np.inf
        self.mask_seconds += time.perf_counter() - started
        self.mask_steps += 1
        return mask

    def no_mask(self) -> np.ndarray:
        """The [1, vocab] zeros bound as logits_mask while no row is constrained."""
        if self._no_mask is None:
            self._no_mask = np.zeros((1, self.vocab_size), np.float32)
        return self._no_mask

    def _bind_columns(self, slots: list[int]) -> int:
        """Bind the adapter columns up to the highest of these slots (by reference: only when the highest
        slot or the rank moves); returns how many."""
        columns = self.adapters.columns(slots)
        # only where every target's delta is ruvllm's kernel: the graph's own operators need all the columns
        idle = self.adapters.idle(columns) if self._lora_all_fused else frozenset()
        if (columns, idle) != self._lora_columns:
            self.lora_runner.bind_static(self.adapters.views(columns, idle))
            self._lora_columns = (columns, idle)
        return columns

    def _xlora_pass(self, xp, columns: int) -> dict[int, list[tuple[int, float]]]:
        """Run the X-LoRA chunks' scaling pass (their experts at PEFT's dummy weights, K/V into their
        shadow blocks), their classifiers on its hidden states; returns each of their tokens' experts'
        weights, by the token's index in the step."""
        from runtime.core.xlora import scaling_mix, step_mix

        weights = self.adapters.mixing([0] * len(xp.batch.input_ids), columns, scaling_mix(xp))
        feeds = {C.LORA_WEIGHTS: weights}
        if self.lora_runner.masked:  # no logits rows here: the [1, vocab] zeros back
            feeds[C.LOGITS_MASK] = self._logits_mask(xp.batch)
            self.lora_runner.masked = False
        self._ensure_pool(xp.batch)
        outs = self.lora_runner.run(xp.batch, feeds, want_hidden=True)
        self.pool.write(outs[C.PRESENT_KEY], outs[C.PRESENT_VALUE], xp.batch.kv_slots, xp.batch)
        hidden = outs[C.HIDDEN_STATES]
        outputs = [self._classifier(g.xlora)(hidden[g.scaling_start:g.scaling_start + g.n]).tolist()
                   for g in xp.groups]
        # per X-LoRA chunk: [tokens][experts], what the step mixed (tests read it)
        mix, self.last_xlora_weights = step_mix(xp, outputs)
        return mix

    def _classifier(self, xlora):
        """The X-LoRA's classifier as a function of hidden states [n, hidden] -> [n, experts]; its
        weights read once."""
        from runtime.backends.adapter_weights import read_tensor

        cache = self._classifiers
        if xlora.id not in cache:
            layers = [(read_tensor(f, w), read_tensor(f, b)) for f, w, b in xlora.classifier]

            def classify(x: np.ndarray) -> np.ndarray:
                for i, (w, b) in enumerate(layers):
                    x = x @ w.T + b
                    if i + 1 < len(layers):
                        x = np.maximum(x, 0.0)  # ReLU (dropout is off at inference)
                return x

            cache[xlora.id] = classify
        return cache[xlora.id]


class GraphRunner:
    """One session and its IOBinding for the session's life: the KV pool bound once, outputs bound to
    preallocated buffers, inputs equal to the last step's neither converted nor bound again."""

    def __init__(self, backend: NativeBackend, session) -> None:
        self.backend, self.session = backend, session
        self.io = session.io_binding()
        self._bound: tuple | None = None  # the output shapes currently bound
        self._bound_inputs: dict[str, tuple] = {}  # input name -> (the values it is bound to, their array)
        self.has_mask = C.LOGITS_MASK in {i.name for i in session.get_inputs()}
        self.has_floors = C.KV_EXACT_FROM in {i.name for i in session.get_inputs()}  # a two-tier int8 pool's
        if self.has_mask:  # zeros until a step has constrained rows
            self.io.bind_cpu_input(C.LOGITS_MASK, backend.no_mask())
        self.masked = False  # logits_mask is bound to a constrained step's rows
        self._outputs: dict[str, object] = {}
        # inputs the rewrite declared fp16 (a quantized package's adapters, graph_rewrite.adapters_in_half)
        self._half = {i.name for i in session.get_inputs() if i.type == "tensor(float16)"}

    def bind_pool(self, pool) -> None:
        pool.bind_layers(self.io, self.backend.num_layers)

    def bind_static(self, inputs: dict[str, np.ndarray]) -> None:
        """Bind arrays once, by reference: writing into them changes what the next run reads."""
        ort = self.backend._ort
        for name, arr in inputs.items():
            self.io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))

    def _bind(self, name: str, key, make) -> None:
        """Bind make(key) to a graph input unless the same key is bound already. The array is kept:
        onnxruntime may read it in place at every run it stays bound for."""
        bound = self._bound_inputs.get(name)
        if bound is None or bound[0] != key:
            arr = make(key)
            self.io.bind_cpu_input(name, arr)
            self._bound_inputs[name] = (key, arr)

    def _bind_outputs(self, num_tokens: int, rows: int, top_k: int, want_logits: bool,
                      want_hidden: bool = False) -> dict[str, object]:
        """Bind every output to a preallocated buffer; a step shaped like the last one rebinds nothing.
        This step's K/V stay on the pool's device; the candidates (and logits, hidden states) come to the host."""
        key = (num_tokens, rows, top_k, want_logits, want_hidden)
        if key == self._bound:
            return self._outputs
        b, io = self.backend, self.io
        io.clear_binding_outputs()
        shape = [b.num_layers, num_tokens, b.kv_heads, b.head_dim]
        outs: dict[str, object] = {}
        for name in (C.PRESENT_KEY, C.PRESENT_VALUE):
            outs[name] = b._ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, b.pool.device, 0)
            io.bind_ortvalue_output(name, outs[name])
        if rows:
            host = {C.TOPK_LOGPROBS: np.empty((rows, top_k), np.float32), C.TOPK_IDS: np.empty((rows, top_k), np.int64)}
            if want_logits:
                host[C.LOGITS] = np.empty((rows, b.vocab_size), np.float32)
            for name, buf in host.items():
                io.bind_output(name, "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)
            outs.update(host)
        if want_hidden:
            buf = outs[C.HIDDEN_STATES] = np.empty((num_tokens, b.pkg.config["hidden_size"]), np.float32)
            io.bind_output(C.HIDDEN_STATES, "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)
        self._bound, self._outputs = key, outs
        return outs

    def run(self, batch: StepBatch, extra_inputs: dict | None = None, want_hidden: bool = False) -> dict[str, object]:
        rows = len(batch.logits_index)
        top_k = min(batch.top_k, self.backend.vocab_size)
        # a decode step repeats most inputs of the last one (sampling settings, padding, indices):
        # rebinding only what changed saves ~10 array conversions and bindings per step
        for name, (values, dims) in batch.feeds(top_k).items():
            self._bind(name, (values, dims), lambda key, t=STEP_DTYPES[name]: np.array(key[0], t).reshape(key[1]))
        if self.has_floors:
            self._bind(C.KV_EXACT_FROM, batch.exact_from, lambda key: np.array(key, np.int64))
        for name, arr in (extra_inputs or {}).items():
            if name in self._half and arr.dtype != np.float16:
                arr = arr.astype(np.float16)
            self.io.bind_cpu_input(name, arr)
            self._bound_inputs[name] = (object(), arr)  # never equal: rebound whenever given
        outs = self._bind_outputs(len(batch.input_ids), rows, top_k, batch.want_full_logits or batch.score_ids is not None,
                                  want_hidden)
        self.session.run_with_iobinding(self.io)
        return outs
