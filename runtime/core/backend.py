"""What the engine asks of a backend: hold the KV pool, run one step's graph. Nothing else.

A backend keeps no scheduling state: each step's batch carries its block tables and the KV slots
its new tokens go to. Natively `run` is called on the step thread; in the page the engine awaits
`run_async` so that Python holds nothing while onnxruntime-web computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from runtime.core.step_batch import StepBatch, StepResult


@dataclass(frozen=True)
class BackendInfo:
    """What a backend runs and how, now: facts the engine, the server and `ruvllm bench` read (a backend's
    display strings are made from its facts, never parsed back into them)."""

    name: str
    device: str  # where steps run: onnxruntime's execution providers, or the page's runner
    kv_dtype: str = "fp32"
    # blocks up to a query's own that the pool reads exact (a two-tier quantized pool's kv_tails.TAIL_BLOCKS
    # once allocated; 1 otherwise): above one the scheduler gives each row a floor (StepBatch.exact_from)
    kv_exact_blocks: int = 1
    # whether a step's attention pads every row to the step's longest chunk (the exported graph's own
    # attention; a ragged kernel does not): the scheduler then caps each row's chunk (Scheduler.pads_rows)
    pads_rows: bool = True
    batch_invariance: str = ""  # what lets a row's numbers depend on its batch; "": nothing does
    matmul_kernel: str = "the graph's own"  # what computes the projections
    attention_kernel: str = "the graph's own"
    lora_kernel: str | None = None  # what computes adapters' deltas, when it is not the graph's own operators
    kv_committed_bytes: int | None = None  # the pool's memory committed so far, where it grows with use
    mask_seconds: float = 0.0  # structured output's masks: time spent, steps masked
    mask_steps: int = 0

    @property
    def batch_invariant(self) -> bool:
        return not self.batch_invariance


class Backend(Protocol):
    name: str

    def info(self) -> BackendInfo:
        """What runs and how, now (an adapter graph or the pool's allocation may change it)."""
        ...

    def kv_bytes_per_token(self, config: dict) -> int:
        """Bytes of K and V one token takes in the pool, over all layers."""
        ...

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Create the KV pool: num_blocks blocks of block_size tokens."""
        ...

    def kv_block_layout(self) -> dict:
        """What a pool block's bytes hold: {"arrays": names in order, "block_bytes": n}; RuntimeError where the
        pool's blocks cannot be read (a GPU's; the page's, whose model worker keeps them)."""
        ...

    def read_kv_blocks(self, blocks: list[int]) -> list[bytes]:
        """Whole pool blocks as the pool stores them (a saved session: runtime/core/kv_sessions.py)."""
        ...

    def write_kv_blocks(self, blocks: list[int], data: list[bytes]) -> None:
        """read_kv_blocks' bytes back into these blocks, before any step reads them."""
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
