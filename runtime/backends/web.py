"""The web backend: onnxruntime-web, driven from Pyodide through its FFI.

The session and the KV pool live in the model's worker (web/src/ort_worker.js, step_runner.js,
kv_pool.js); a step sends only the small per-step arrays and gets back the top-K candidates, so
Python never copies a KV tensor. The AsyncEngine awaits `run_async` between Engine.prepare_step and
Engine.finish_step (the same scheduling and sampling code as natively), so the page drives steps
through AsyncEngine; there is no synchronous `run`. With an adapter added, every step runs on the LoRA
graph (web/src/lora_store.js holds the adapters' columns and X-LoRA classifiers).
"""

from __future__ import annotations

from runtime import contract as C
from runtime.core.backend import BackendInfo
from runtime.core.kv_blocks import kv_bytes_per_token, kv_group, kv_row_bytes, kv_scale_widths
from runtime.core.kv_tails import TAIL_BLOCKS, TailSlots
from runtime.core.step_batch import StepBatch, StepResult
from runtime.core.xlora import mix_sets
from runtime.errors import DeviceError
from runtime.package import ModelPackage


class WebBackend:
    name = "onnxruntime-web"

    def __init__(self, package: ModelPackage, runner, kv_dtype: str = "fp32", stepper: str = "onnxruntime") -> None:
        """runner: the JS RemoteRunner whose model worker owns the InferenceSession (or the WASM step: stepper
        "wasm-step") and the KV pool. kv_dtype "int8" on onnxruntime-web: the model worker runs the package's
        int8-KV graph (decoder_kv8) on a one-tier pool of int8 rows and fp16 group scales, which it quantizes as
        the native pool does. "int8" or "int4" on the WASM step: the native engine's two-tier pool (rows
        quantized bit for bit as kv_pool.py's, the blocks being written kept exact too in tail slots, which
        kv_tails.TailSlots assigns here)."""
        if kv_dtype not in C.KV_DTYPES:
            raise DeviceError(f"kvDtype {kv_dtype!r}: choose one of {', '.join(C.KV_DTYPES)}")
        self.on_step = stepper == "wasm-step"
        if kv_dtype == "int4" and not self.on_step:
            raise DeviceError("kvDtype 'int4' runs on the page's WASM step only (backend 'wasm-step' or 'auto', a "
                              "package exported from a GGUF with --target wasm); use 'int8' or 'fp32' on onnxruntime-web")
        if kv_dtype == "int8" and not self.on_step and "decoder_kv8" not in package.manifest.get("graphs", {}):
            raise DeviceError("kvDtype 'int8': this model package has no int8-KV graph (model_kv8.onnx); re-export it")
        self.kv_dtype = kv_dtype
        two_tier = self.on_step and kv_dtype != "fp32"
        self.kv_exact_blocks = TAIL_BLOCKS if two_tier else 1  # the scheduler's floors follow it
        self.tails: TailSlots | None = None  # a two-tier pool's tail slots, made by allocate
        self.pkg = package
        self.runner = runner
        self.vocab_size = package.config["vocab_size"]
        self.lora: dict | None = None  # once an adapter is added: slots, columns per slot, what each holds
        self._guide = None  # structured output's guide, made on the first constrained request

    def info(self) -> BackendInfo:
        """The WASM step computes each token alone (ragged, batch-invariant); onnxruntime-web the graph's own way."""
        if self.on_step:
            return BackendInfo("wasm-step", "wasm", self.kv_dtype, self.kv_exact_blocks, False, "",
                               "the WASM step's block dots", "the WASM step's paged attention")
        return BackendInfo(self.name, "onnxruntime-web", self.kv_dtype, self.kv_exact_blocks, True,
                           "attention and projections on onnxruntime-web's kernels")

    def kv_bytes_per_token(self, cfg: dict) -> int:
        return kv_bytes_per_token(cfg, self.kv_dtype)

    def kv_block_layout(self, *_) -> dict:
        raise RuntimeError("the page's KV pool lives in its model worker: there the last prompt's blocks are kept in "
                           "OPFS across reloads (web/src/prompt_kv.js), not saved as sessions")

    read_kv_blocks = write_kv_blocks = kv_block_layout

    def allocate(self, num_blocks: int, block_size: int) -> None:
        from js import Object
        from pyodide.ffi import to_js

        roles = dict(self.pkg.io_roles)
        # the step's inputs by part, for a runner that reads them itself (web/src/wasm_step.js)
        roles["step_feeds"] = {"ids": C.INPUT_IDS, "positions": C.POSITION_IDS, "query_index": C.QUERY_INDEX,
                               "block_tables": C.BLOCK_TABLES, "logits_index": C.LOGITS_INDEX,
                               "temperature": C.TEMPERATURE, "repetition": C.REPETITION_PENALTY,
                               "presence": C.PRESENCE_PENALTY, "frequency": C.FREQUENCY_PENALTY,
                               "sparse_ids": C.SPARSE_IDS, "sparse_seen": C.SPARSE_SEEN,
                               "sparse_counts": C.SPARSE_COUNTS, "sparse_bias": C.SPARSE_BIAS, "top_k": C.TOP_K}
        d = self.pkg.config["head_dim"]
        # the WASM step's pool: each kind's bytes of numbers and of fp16 scales a row, the blocks read exact
        roles["kv_layout"] = {"dtype": self.kv_dtype, "tail_blocks": self.kv_exact_blocks,
                              "numbers": [kv_row_bytes(d, self.kv_dtype, k) - 2 * w
                                          for k, w in enumerate(kv_scale_widths(d, self.kv_dtype))],
                              "scales": list(kv_scale_widths(d, self.kv_dtype))}
        if self.kv_exact_blocks > 1:
            self.tails = TailSlots(block_size, self.kv_exact_blocks)
        if self.kv_dtype == "int8" and not self.on_step:  # the int8-KV graph's scale inputs, and the rows' layout
            n = self.pkg.config["num_layers"]
            roles.update(kv_dtype="int8", kv_group=kv_group(self.pkg.config["head_dim"]),
                         past_key_scales=[C.past_key_scale(i) for i in range(n)],
                         past_value_scales=[C.past_value_scale(i) for i in range(n)])
        self.runner.allocate(num_blocks, block_size, to_js(roles, dict_converter=Object.fromEntries))

    def enable_lora(self, max_loras: int, max_rank: int, xlora: bool = False) -> None:
        """Have the model worker open the LoRA graph, which then runs every step (adapter columns at zero
        weight for the base model): one session's weights in the page's memory, not two. On the WASM step
        the adapters run on the step itself, which refuses an X-LoRA (`xlora`)."""
        from js import Object
        from pyodide.ffi import to_js

        from runtime.core.adapters import AdapterError, target_features

        if self.lora is not None:
            return
        if self.kv_dtype == "int8" and not self.on_step:
            raise AdapterError("adapters with kvDtype 'int8' run on the WASM step only (onnxruntime-web has no LoRA "
                               "graph on an int8 pool): load the engine with kvDtype 'fp32', or on backend 'wasm-step'")
        if not self.on_step and "decoder_lora" not in self.pkg.manifest.get("graphs", {}):
            raise AdapterError("this model package has no LoRA graph (exported with --no-lora); re-export it")
        features = target_features(self.pkg.config)
        layers = self.pkg.config["num_layers"]
        spec = {"maxColumns": max_loras * max_rank, "weights": C.LORA_WEIGHTS, "xlora": xlora,
                "targets": [[t, fin, fout, [[C.lora_a(i, t), C.lora_b(i, t)] for i in range(layers)]]
                            for t, (fin, fout) in features.items()]}
        try:
            self.runner.enable_lora(to_js(spec, dict_converter=Object.fromEntries))
        except Exception as err:  # the model worker's backend refuses them (an X-LoRA on the WASM step): nothing changed
            raise AdapterError(str(err).removeprefix("Error: ")) from err
        self.lora = {"max_loras": max_loras, "max_rank": max_rank, "rank": 0, "holders": {}}

    def enable_xlora(self, max_loras: int, max_rank: int, xlora) -> None:
        """enable_lora, and send the X-LoRA's classifier (its Linear layers' bytes) to the model worker."""
        from js import Uint8Array
        from pyodide.ffi import to_js

        from runtime.core.adapters import AdapterError

        self.enable_lora(max_loras, max_rank, xlora=True)
        layers, blobs = [], []
        for file, w, b in xlora.classifier:
            with open(file, "rb") as fh:
                for ref in (w, b):
                    fh.seek(ref.start)
                    blobs.append(Uint8Array.new(to_js(fh.read(ref.end - ref.start))))
            layers.append([[0, w.end - w.start, w.dtype, list(w.shape)], [0, b.end - b.start, b.dtype, list(b.shape)]])
        try:
            self.runner.set_classifier(xlora.id, to_js(layers), to_js(blobs))
        except Exception as err:  # the model worker's backend refuses X-LoRA (the WASM step by name)
            raise AdapterError(str(err).removeprefix("Error: ")) from err

    def set_adapter(self, slot: int, adapter) -> None:
        """Send an adapter's weights (the file's bytes and where each tensor is) into a slot of the model
        worker's LoRA inputs; each slot takes the largest rank loaded so far, so a wider one lays every
        loaded adapter out again."""
        lora = self.lora
        lora["holders"][slot] = adapter
        if adapter.rank > lora["rank"]:
            lora["rank"] = adapter.rank
            for s, held in lora["holders"].items():
                self._send_adapter(s, held)
        else:
            self._send_adapter(slot, adapter)

    def _send_adapter(self, slot: int, info) -> None:
        from js import Object, Uint8Array
        from pyodide.ffi import to_js

        def ref(r):
            return [r.start, r.end, r.dtype, list(r.shape)]

        if info.kind == "peft":  # per layer and target: A [r, in], B [out, r], the scale apart
            parts = [[layer, t, "peft", ref(p.a), ref(p.b), p.scale] for (layer, t), p in info.parts.items()]
        else:  # the exporter's: per target A [layers, in, r], B [layers, r, out], the scale folded in
            parts = [[-1, t, "stacked", ref(a), ref(b), 1.0] for t, (a, b) in info.stacked.items()]
        data = info.weights.read_bytes()
        self.runner.set_adapter(to_js({"slot": slot, "columns": self.lora["rank"], "rank": info.rank, "parts": parts},
                                      dict_converter=Object.fromEntries), Uint8Array.new(to_js(data)))

    def _lora_feed(self, batch: StepBatch, mix: dict | None = None, slots: list[int] | None = None) -> dict | None:
        """The step's adapter columns and per-token weights: one-hot by slot (base tokens all zero), or for
        a token in `mix` (X-LoRA) each of its experts' slots at its weight."""
        if self.lora is None:
            return None
        rank = max(self.lora["rank"], 1)
        token_slots = batch.adapter_slots or [0] * len(batch.input_ids)
        columns = max(max(slots or batch.lora_slots()) * rank, 1)
        # layerwise X-LoRA: a list of weights per weight set (adapter_weights.AdapterTensors.mixing)
        sets = mix_sets(mix)
        weights = []
        for t, s in enumerate(token_slots):
            row = [0.0] * (sets * columns)
            for slot, w in (mix or {}).get(t, [(s, 1.0)] if s else []):
                for k in range(sets):
                    at = k * columns + (slot - 1) * rank
                    row[at:at + rank] = [w[k] if isinstance(w, list) else w] * rank
            weights.extend(row)
        return {"columns": columns, "sets": sets, "weights": weights}

    def guide(self, tokenizer):
        """The page's structured-output guide (runtime/core/token_guide.py: llguidance has no Pyodide
        build), made on the first constrained request."""
        if self._guide is None:
            from runtime.core.token_guide import PyGuide
            from runtime.errors import RequestError

            if C.LOGITS_MASK not in {i["name"] for i in self.pkg.manifest.get("io", {}).get("inputs", [])}:
                raise RequestError(f"this package's graph has no {C.LOGITS_MASK} input, which structured output "
                                   "needs; re-export it", "response_format")
            self._guide = PyGuide.from_tokenizer(tokenizer, self.vocab_size, self.pkg.eos_token_ids)
        return self._guide

    def run(self, batch: StepBatch) -> StepResult:
        raise RuntimeError("a page step runs in another worker: await run_async (AsyncEngine does)")

    async def run_async(self, batch: StepBatch) -> StepResult:
        """The page's path (AsyncEngine awaits it): nothing of Python's stack is held while the model runs.
        X-LoRA chunks first run their scaling pass, whose hidden states the model worker classifies."""
        mix = await self._xlora_pass(batch.xlora) if batch.xlora else None
        reply = await self._run(batch, self._lora_feed(batch, mix))
        if not batch.logits_index:
            return StepResult([], [])
        return StepResult(reply["topk_ids"], reply["topk_logprobs"], reply.get("logits"), reply.get("scores"))

    async def _run(self, batch: StepBatch, lora: dict | None, classify: list | None = None) -> dict:
        from js import Object
        from pyodide.ffi import to_js

        feeds = batch.feeds(min(batch.top_k, self.vocab_size))
        if not batch.logits_index:
            # onnxruntime-web's WASM TopK traps ("divide by zero") on a [0, vocab] input, which a step of
            # prompt chunks only would give it: score one placeholder row (the last token) and drop it
            feeds.update({C.LOGITS_INDEX: ([len(batch.input_ids) - 1], [1]), C.TEMPERATURE: ([1.0], [1]),
                          C.REPETITION_PENALTY: ([1.0], [1]), C.PRESENCE_PENALTY: ([0.0], [1]),
                          C.FREQUENCY_PENALTY: ([0.0], [1])})
            feeds.update({name: ([[0]], [1, 1]) for name in (C.SPARSE_IDS, C.SPARSE_SEEN, C.SPARSE_COUNTS,
                                                             C.SPARSE_BIAS)})
        step = {
            "feeds": feeds, "rows": len(batch.logits_index),
            "kv_slots": batch.kv_slots, "blocks_needed": 1 + max(max(t) for t in batch.block_tables),
            "want_logits": batch.want_full_logits, "score_ids": batch.score_ids, "lora": lora,
            "classify": classify and {"hidden": C.HIDDEN_STATES, "groups": classify},
            # structured output: per logits row its allowed tokens as a bitmask (None: unconstrained)
            "mask": batch.matchers and [m and m.allowed_bits() for m in batch.matchers],
        }
        if self.tails is not None:  # the tokens kept exact too, and the tail slots' changes before the step
            keep, changes = self.tails.step_slots(batch)
            step["tails"] = {"keep": keep, "changes": changes, "exact_from": batch.exact_from}
        return (await self.runner.run(to_js(step, dict_converter=Object.fromEntries))).to_py()

    async def _xlora_pass(self, xp) -> dict[int, list[tuple[int, float]]]:
        """The X-LoRA chunks' scaling pass (K/V into their shadow blocks); the model worker runs their
        classifiers on its hidden states; returns each of their tokens' experts' weights by step index."""
        from runtime.core.xlora import scaling_mix, step_mix

        slots = [s for g in xp.groups for s in g.expert_slots]
        reply = await self._run(xp.batch, self._lora_feed(xp.batch, scaling_mix(xp), slots),
                                [[g.xlora.id, g.scaling_start, g.n] for g in xp.groups])
        return step_mix(xp, reply["classified"])[0]
