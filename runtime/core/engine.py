"""The engine: requests in, token deltas out, many sequences batched per step on paged KV.

A step is schedule -> run -> process: the Scheduler decides what runs and in which KV blocks, the
backend (native onnxruntime, or onnxruntime-web in the page) runs the graph, and the
OutputProcessor chooses tokens, stops and detokenizes. Pure standard library.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from runtime.core.adapters import AdapterInfo, AdapterRegistry
from runtime.core.backend import Backend
from runtime.core.config import DEFAULT_KV_MEMORY, EngineConfig, ModelConfig
from runtime.core.generation_defaults import package_defaults, request_defaults
from runtime.core.output_processor import OutputProcessor
from runtime.core.sampling import SamplingParams
from runtime.core.scheduler import Scheduler, SchedulerOutput
from runtime.core.sequence import RequestOutput, Sequence, TokenLogprob
from runtime.core.stats import EngineStats
from runtime.core.step_batch import StepBatch, StepResult, build_step
from runtime.core.xlora import XLoraInfo
from runtime.errors import ContextLengthError, RequestError
from runtime.package import ModelPackage, load_package
from runtime.text.prompt import PromptEncoder, package_tokenizer
from runtime.text.reasoning import ThinkingBudget, prompt_state
from runtime.text.tokenizer import Tokenizer

__all__ = ["DEFAULT_KV_MEMORY", "Engine", "PreparedRequest", "PreparedStep", "RequestOutput", "TokenLogprob"]


@dataclass
class PreparedRequest:
    """A request tokenized and validated, not yet queued."""

    ids: list[int]
    params: SamplingParams
    adapter: AdapterInfo | XLoraInfo | None = None
    matcher: object = None  # structured output: the request's grammar matcher


@dataclass
class PreparedStep:
    """A scheduled step and its graph inputs, between prepare_step and finish_step."""

    scheduled: SchedulerOutput
    batch: StepBatch


class Engine:
    def __init__(self, package: ModelPackage, backend: Backend, config: EngineConfig | None = None, *,
                 tokenizer: Tokenizer | None = None, **options) -> None:
        """options: EngineConfig fields (num_blocks, kv_memory, max_num_seqs, ...) over `config`."""
        self.pkg = package
        self.backend = backend
        config = EngineConfig(**{**(config.__dict__ if config else {}), **options})
        self.config = config = config.invariant_for(self.batch_invariance)
        self.model = ModelConfig.from_manifest(package.manifest)
        self.max_context = self.model.max_context
        self.vocab_size = self.model.vocab_size
        self.block_size = config.block_size or self.model.block_size
        num_blocks = config.pool_blocks(self.block_size, backend.kv_bytes_per_token(package.config), self.max_context)
        backend.allocate(num_blocks, self.block_size)
        self.stats = EngineStats()
        info = backend.info()
        self.scheduler = Scheduler(config, num_blocks, self.block_size, self.max_context, self.vocab_size, self.stats,
                                   exact_blocks=info.kv_exact_blocks, pads_rows=info.pads_rows)
        self.prompts = PromptEncoder.from_package(package, self.vocab_size, self.max_context, tokenizer)
        self.tokenizer, self.chat_template = self.prompts.tokenizer, self.prompts.chat_template
        self.processor = OutputProcessor(self.tokenizer, self.model, self.stats)
        self.think = self.prompts.think  # a reasoning model's thinking tags, or None
        self._ids = itertools.count()
        self.adapters = AdapterRegistry(package, backend, self.config)
        # what a request leaves out: the model's generation settings, else chat defaults
        self.sampling_defaults = package_defaults(package)

    @property
    def batch_invariance(self) -> str:
        """What breaks batch invariance on this backend now ("": nothing); an adapter added later may change it."""
        return self.backend.info().batch_invariance

    @classmethod
    def from_package(cls, path, device: str = "cpu", threads: int | None = None, verify: bool = True,
                     **options) -> Engine:
        """verify: check every file's sha256 first (cached by size and mtime; see package.verify_files)."""
        from concurrent.futures import ThreadPoolExecutor

        pkg = load_package(path, verify_hashes=verify)
        kv_dtype = options.pop("kv_dtype", None) or "fp32"  # the backend's pool, not the scheduler's
        given = options.pop("tokenizer", None)
        with ThreadPoolExecutor(1) as pool:  # the tokenizer (parsed without the GIL) while the graph opens
            loading = None if given else pool.submit(package_tokenizer, pkg)
            from runtime.backends.native import NativeBackend

            backend = NativeBackend(pkg, device=device, threads=threads, kv_dtype=kv_dtype)
            tokenizer = given or loading.result()
        return cls(pkg, backend, tokenizer=tokenizer, **options)

    # ---- requests ----
    def sampling_params(self, **given) -> SamplingParams:
        """SamplingParams of the fields given (None: not given) over this model's defaults (generation_defaults)."""
        return SamplingParams(**request_defaults(self.sampling_defaults, given))

    def encode_prompt(self, prompt=None, messages: list[dict] | None = None, tools: list[dict] | None = None) -> list[int]:
        return self.prompts.encode(prompt, messages, tools)

    def prepare_request(self, prompt=None, params: SamplingParams | None = None, *,
                        messages: list[dict] | None = None, adapter: str | None = None) -> PreparedRequest:
        """Tokenize and validate a request, touching no engine state (AsyncEngine calls it outside its lock)."""
        info = self.adapters.named(adapter)
        params = params or self.sampling_params()
        params.validate(self.vocab_size)
        ids = self.prompts.request_ids(prompt, messages)
        alloc = self.scheduler.allocator
        passes = 2 if info is not None and info.kind == "xlora" else 1  # X-LoRA: the scaling pass's K/V too
        if passes * alloc.blocks_for(len(ids) + 1) > alloc.num_blocks:
            raise ContextLengthError(f"the prompt has {len(ids)} tokens, more than the KV cache holds "
                                     f"({alloc.num_blocks * self.block_size // passes} tokens"
                                     f"{' with X-LoRA' if passes == 2 else ''})")
        matcher = self.backend.guide(self.tokenizer).matcher(params.constraint) if params.constraint is not None else None
        return PreparedRequest(ids, params, info, matcher)

    def submit(self, request: PreparedRequest, request_id: str | None = None) -> str:
        """Queue a prepared request; returns its id."""
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.scheduler.seqs:
            raise RequestError(f"request id {rid!r} is already in use")
        info = request.adapter
        seq = Sequence(rid, request.ids, request.params, tokens=list(request.ids), adapter=info.id if info else None,
                       xlora=info if info is not None and info.kind == "xlora" else None, matcher=request.matcher)
        if request.params.thinking_budget is not None and self.think is not None:
            seq.thinking = ThinkingBudget(self.think, request.params.thinking_budget,
                                          prompt_state(request.ids, self.think, self.tokenizer.decode))
        self.processor.admit(seq)
        self.scheduler.add(seq)
        return rid

    def add_request(self, prompt=None, params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                    request_id: str | None = None, adapter: str | None = None) -> str:
        """adapter: the name of an adapter added with adapters.add (None: the base model)."""
        return self.submit(self.prepare_request(prompt, params, messages=messages, adapter=adapter), request_id)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    @property
    def seqs(self) -> dict[str, Sequence]:
        return self.scheduler.seqs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        return self.scheduler.reset_prefix_cache()

    def save_session(self, path, tokens: list[int] | None = None) -> dict:
        """Save the cached K/V that begin `tokens` (default: the last finished request's prompt and answer) to a
        file (runtime/core/kv_sessions.py); call between steps."""
        from runtime.core import kv_sessions

        recent, adapter = self.scheduler.recent_tokens
        return kv_sessions.save(self, path, recent if tokens is None else tokens, adapter if tokens is None else None)

    def restore_session(self, path) -> dict:
        """Read a saved session into the prefix cache: later prompts that begin with its tokens skip their prefill.
        Its tokens become what save_session saves by default."""
        from runtime.core import kv_sessions

        done = kv_sessions.restore(self, path)
        self.scheduler.recent_tokens = (done["token_ids"], None)
        return done

    # ---- the step: schedule -> run -> process ----
    def step(self) -> list[RequestOutput]:
        prepared = self.prepare_step()
        if prepared is None:
            return []
        return self.finish_step(prepared, self.backend.run(prepared.batch))

    def prepare_step(self) -> PreparedStep | None:
        """Schedule the next step and build its graph inputs; None when there is nothing to run.
        An asynchronous caller awaits the backend between this and finish_step, with requests added
        or aborted meanwhile."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return None
        self.adapters.load_slots(self.scheduler.slots.take_loads())
        batch = build_step(scheduled.chunks, self.block_size)
        batch.dropped_blocks = scheduled.dropped_blocks
        return PreparedStep(scheduled, batch)

    def finish_step(self, prepared: PreparedStep, result: StepResult) -> list[RequestOutput]:
        """Choose tokens from the step's candidates, then let the scheduler account what was computed."""
        self.stats.steps += 1
        outputs: list[RequestOutput] = []
        # per logits row in order: a chunk's scored prompt rows first (with their scores), then its sampled rows
        scores = result.scores or [0.0] * len(result.topk_ids)
        rows = iter(zip(zip(result.topk_ids, result.topk_logprobs), scores))
        for (seq, n), chunk in zip(prepared.scheduled.scheduled, prepared.scheduled.chunks):
            scored = [next(rows) for _ in range(chunk.scored)]
            candidates = [next(rows)[0] for _ in range(chunk.logits_rows)] if chunk.want_logits else []
            if seq.finished:  # aborted while the step ran: its blocks are gone already
                continue
            if scored:
                self.processor.score_prompt(seq, chunk, scored)
            drafted = len(seq.draft)
            if chunk.want_logits and seq.params.max_tokens == 0 and not seq.num_generated:
                emitted = [self.processor.prompt_only(seq)]  # the prompt computed (and scored), nothing generated
            else:
                emitted = self.processor.process(seq, candidates, seq.draft)
            if emitted and seq.scores_prompt:
                emitted[0].prompt_logprobs = seq.prompt_scores
                seq.prompt_scores_sent = True
            accepted = max(0, len(emitted) - 1)  # every emitted token but the last confirmed its draft
            self.scheduler.update(seq, n - drafted + accepted, accepted, bool(emitted) and emitted[-1].finished)
            outputs.extend(emitted)
        return outputs

    def stats_snapshot(self) -> dict:
        return self.stats.snapshot(self.scheduler)

    # ---- convenience ----
    def generate(self, prompt=None, params: SamplingParams | None = None, *, messages=None, adapter: str | None = None):
        """Run one request to completion, yielding its outputs (other queued requests run too)."""
        rid = self.add_request(prompt, params, messages=messages, adapter=adapter)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return
            if rid not in self.seqs:
                return
