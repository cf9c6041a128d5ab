"""The web backend: onnxruntime-web, driven from Pyodide through its FFI.

The session and the KV pool live in the model's worker (web/src/ort_worker.js, step_runner.js,
kv_pool.js); a step sends only the small per-step arrays and gets back the top-K candidates, so
Python never copies a KV tensor. The AsyncEngine awaits `run_async` between Engine.prepare_step and
Engine.finish_step (the same scheduling and sampling code as natively), so the page drives steps
through AsyncEngine; there is no synchronous `run`. LoRA adapters are native-only for now.
"""

from __future__ import annotations

from runtime import contract as C
from runtime.core.kv_blocks import kv_bytes_per_token
from runtime.core.step_batch import StepBatch, StepResult
from runtime.package import ModelPackage


class WebBackend:
    name = "onnxruntime-web"

    def __init__(self, package: ModelPackage, runner) -> None:
        """runner: the JS RemoteRunner whose model worker owns the InferenceSession and the KV pool."""
        self.pkg = package
        self.runner = runner
        self.vocab_size = package.config["vocab_size"]

    kv_bytes_per_token = staticmethod(kv_bytes_per_token)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        from js import Object
        from pyodide.ffi import to_js

        self.runner.allocate(num_blocks, block_size, to_js(self.pkg.io_roles, dict_converter=Object.fromEntries))

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        from runtime.core.adapters import AdapterError

        raise AdapterError("LoRA adapters run natively only for now (not yet in the page)")

    def enable_xlora(self, max_loras: int, max_rank: int, xlora) -> None:
        self.enable_lora(max_loras, max_rank)

    def set_adapter(self, slot: int, adapter) -> None:
        self.enable_lora(0, 0)

    def run(self, batch: StepBatch) -> StepResult:
        raise RuntimeError("a page step runs in another worker: await run_async (AsyncEngine does)")

    async def run_async(self, batch: StepBatch) -> StepResult:
        """The page's path (AsyncEngine awaits it): nothing of Python's stack is held while the model runs."""
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
            "want_logits": batch.want_full_logits,
        }
        reply = (await self.runner.run(to_js(step, dict_converter=Object.fromEntries))).to_py()
        if not batch.logits_index:
            return StepResult([], [])
        return StepResult(reply["topk_ids"], reply["topk_logprobs"], reply.get("logits"))
