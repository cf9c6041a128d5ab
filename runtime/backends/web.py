"""The web backend: onnxruntime-web, driven from Pyodide through its FFI.

The session and the KV pool live in the model's worker (web/src/ort_worker.js, step_runner.js,
kv_pool.js); a step sends only the small per-step arrays and gets back the top-K candidates, so
Python never copies a KV tensor. The AsyncEngine awaits `run_async` between Engine.prepare_step and
Engine.finish_step (the same scheduling and sampling code as natively), so the page drives steps
through AsyncEngine; there is no synchronous `run`. LoRA adapters are native-only for now.
"""

from __future__ import annotations

from runtime.kv_blocks import kv_bytes_per_token
from runtime.package import ModelPackage
from runtime.step_batch import StepBatch, StepResult


class WebBackend:
    name = "onnxruntime-web"

    def __init__(self, package: ModelPackage, runner) -> None:
        """runner: the JS RemoteRunner whose model worker owns the InferenceSession and the KV pool."""
        self.pkg = package
        self.runner = runner
        self.vocab_size = package.config["vocab_size"]
        self.block_tables: list[list[int]] = []

    kv_bytes_per_token = staticmethod(kv_bytes_per_token)

    def allocate(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int) -> None:
        self.block_tables = [[0] * max_blocks_per_seq for _ in range(max_seqs)]
        self.runner.allocate(num_blocks, block_size)

    def set_block(self, slot: int, index: int, block: int) -> None:
        self.block_tables[slot][index] = block

    async def run_async(self, batch: StepBatch) -> StepResult:
        """The page's path (AsyncEngine awaits it): nothing of Python's stack is held while the model runs."""
        from js import Object
        from pyodide.ffi import to_js

        tables = [self.block_tables[s][:batch.max_blocks] for s in batch.slots]
        step = {
            "input_ids": batch.input_ids, "position_ids": batch.position_ids,
            "query_index": batch.query_index, "flat_index": batch.flat_index, "block_tables": tables,
            "logits_index": batch.logits_index, "temperature": batch.temperature,
            "repetition_penalty": batch.repetition_penalty, "presence_penalty": batch.presence_penalty,
            "frequency_penalty": batch.frequency_penalty, "sparse_token_ids": batch.sparse_ids,
            "sparse_token_seen": batch.sparse_seen, "sparse_token_counts": batch.sparse_counts,
            "sparse_logit_bias": batch.sparse_bias, "top_k": min(batch.top_k, self.vocab_size),
            "kv_slots": batch.kv_slots, "blocks_needed": 1 + max(max(t) for t in tables),
            "want_logits": batch.want_full_logits,
        }
        reply = (await self.runner.run(to_js(step, dict_converter=Object.fromEntries))).to_py()
        if not batch.logits_index:
            return StepResult([], [])
        return StepResult(reply["topk_ids"], reply["topk_logprobs"], reply.get("logits"))
