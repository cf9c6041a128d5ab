"""The web backend: onnxruntime-web, driven from Pyodide through its FFI.

The session and the KV pool live on the JS side (web/src/kv_pool.js, web/src/step_runner.js); a
step sends only the small per-step arrays and gets back the top-K candidates, so Python never
copies a KV tensor. `run_sync` suspends the step on the session's promise (JSPI, Chromium ≥ 137),
which keeps Engine.step synchronous, the same code as natively.
"""

from __future__ import annotations

from runtime.package import ModelPackage
from runtime.step_batch import StepBatch, StepResult


class WebBackend:
    name = "onnxruntime-web"

    def __init__(self, package: ModelPackage, runner) -> None:
        """runner: the JS StepRunner that owns the InferenceSession and the KV pool."""
        self.pkg = package
        self.runner = runner
        self.vocab_size = package.config["vocab_size"]
        self.block_tables: list[list[int]] = []

    @staticmethod
    def kv_bytes_per_token(cfg: dict) -> int:
        return cfg["num_layers"] * 2 * cfg["num_kv_heads"] * cfg["head_dim"] * 4

    def allocate(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int) -> None:
        self.block_tables = [[0] * max_blocks_per_seq for _ in range(max_seqs)]
        self.runner.allocate(num_blocks, block_size)

    def set_block(self, slot: int, index: int, block: int) -> None:
        self.block_tables[slot][index] = block

    def run(self, batch: StepBatch, extra_inputs: dict | None = None) -> StepResult:
        from js import Object
        from pyodide.ffi import run_sync, to_js

        if extra_inputs:
            raise NotImplementedError("LoRA adapters are not supported in the browser yet")
        tables = [self.block_tables[s][:batch.max_blocks] for s in batch.slots]
        rows = len(batch.logits_index)
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
        result = run_sync(self.runner.run(to_js(step, dict_converter=Object.fromEntries))).to_py()
        if not rows:
            return StepResult([], [])
        return StepResult(result["topk_ids"], result["topk_logprobs"], result.get("logits"))
