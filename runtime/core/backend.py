"""What the engine asks of a backend: hold the KV pool, run one step's graph. Nothing else.

A backend keeps no scheduling state: each step's batch carries its block tables and the KV slots
its new tokens go to. Natively `run` is called on the step thread; in the page the engine awaits
`run_async` so that Python holds nothing while onnxruntime-web computes.
"""

from __future__ import annotations

from typing import Protocol

from runtime.core.step_batch import StepBatch, StepResult


class Backend(Protocol):
    name: str
    # blocks up to a query's own that the pool reads exact, set by allocate (a two-tier int8 pool's
    # kv_tails.TAIL_BLOCKS; 1 otherwise): above one the scheduler gives each row a floor (StepBatch.exact_from)
    kv_exact_blocks: int
    # whether a step's attention pads every row to the step's longest chunk (the exported graph's own
    # attention; a ragged kernel does not): the scheduler then caps each row's chunk (Scheduler.pads_rows)
    pads_rows: bool

    def kv_bytes_per_token(self, config: dict) -> int:
        """Bytes of K and V one token takes in the pool, over all layers."""
        ...

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Create the KV pool: num_blocks blocks of block_size tokens."""
        ...

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """Get ready to run steps whose batch names adapter slots (the LoRA graph); AdapterError if it cannot."""
        ...

    def enable_xlora(self, max_loras: int, max_rank: int, xlora) -> None:
        """enable_lora, and get ready to run an X-LoRA's classifier (runtime.core.xlora.XLoraInfo) on the
        scaling pass's hidden states; AdapterError if it cannot."""
        ...

    def set_adapter(self, slot: int, adapter) -> None:
        """Put an adapter (runtime.core.adapters.AdapterInfo) into one of the LoRA graph's slots."""
        ...

    def guide(self, tokenizer):
        """What compiles a request's structured-output constraint (runtime.core.constraints.Constraint)
        into a Matcher for this package and its tokenizer (runtime.text.tokenizer.Tokenizer):
        `.matcher(constraint)`; RequestError when it cannot."""
        ...

    def run(self, batch: StepBatch) -> StepResult:
        """Run one step: write its K/V into the pool and return the candidates of its logits rows (with
        X-LoRA chunks: their scaling pass first, its K/V into their shadow blocks)."""
        ...

    async def run_async(self, batch: StepBatch) -> StepResult:
        """`run`, awaitable: the page's backend does its work in another worker."""
        ...
