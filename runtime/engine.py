"""The engine: requests in, token deltas out, many sequences batched per step on paged KV.

Pure standard library; the backend (native onnxruntime, or onnxruntime-web in the page) does
the tensor work. Scheduling is FCFS with a per-step token budget: running sequences first
(decodes, then unfinished prompt chunks), then waiting ones admitted while KV blocks last; a waiting
prompt whose next blocks this step computes for another waits a step and takes them from the cache.
When the pool runs out, the newest running sequence is preempted and later recomputed. Greedy
decodes may verify prompt-lookup drafts in the same step (runtime/speculative.py).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from runtime.chat_template import ChatTemplate
from runtime.errors import ContextLengthError, RequestError
from runtime.kv_blocks import BlockAllocator, block_key
from runtime.package import ModelPackage, load_package
from runtime.sampling import SamplingParams, choose, make_rng
from runtime.speculative import PromptLookup
from runtime.step_batch import Chunk, PenaltyState, StepBatch, build_step, table_width
from runtime.stop import StopChecker
from runtime.tokenizer import IncrementalDecoder, Tokenizer

DEFAULT_KV_MEMORY = 512 * 1024 * 1024


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    request_id: str
    delta: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(eq=False)  # identity: the scheduler's list lookups compare sequences, not their token lists
class Sequence:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    slot: int = -1
    decoder: IncrementalDecoder | None = None
    stopper: StopChecker | None = None
    penalties: PenaltyState | None = None
    rng: object = None
    adapter: str | None = None
    block_keys: list[bytes] = field(default_factory=list)  # prefix keys of its computed full blocks
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    lookup: PromptLookup | None = None  # n-gram index for drafting (speculative decoding)
    draft: list[int] = field(default_factory=list)  # tokens drafted for the step being run
    prefix_keys: tuple[int, list[bytes]] | None = None  # (token count, keys) while waiting: _prefix_keys

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)


@dataclass
class PreparedStep:
    plan: list[tuple[Sequence, int]]  # (sequence, tokens computed this step)
    chunks: list[Chunk]
    batch: StepBatch


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    preemptions: int = 0
    aborted: int = 0
    peak_running: int = 0  # most sequences in one step
    draft_tokens: int = 0  # tokens proposed by prompt lookup
    accepted_draft_tokens: int = 0  # of which verified (each saves a step)
    started: float = field(default_factory=time.monotonic)


# At most this many prompt-lookup drafts per decode step (how many, and when a sequence pauses, is
# PromptLookup's policy, with its measurements), and the most running sequences that still draft. One
# sequence's step with 1/2/3 drafts costs ~1.1-1.25/1.25-1.4/1.45-1.5 plain steps natively (host-dependent)
# and 1.15/1.23/1.49 in onnxruntime-web; at 2 streams drafting still gained ~5%, from 4 on it loses (a batch
# step is compute-bound), hence the cap. Sampled requests draft up to SPECULATIVE_MAX_TEMPERATURE: replaying
# 60 sampled SmolLM2 answers through those costs, drafting gained 5-10% at temperature 0.3 (SmolLM2's card
# suggests 0.2), -5% to +3% at 0.7-1.0, where a sampled token rarely repeats what came before.
SPECULATIVE_TOKENS = 3
SPECULATIVE_MAX_BATCH = 2
SPECULATIVE_MAX_TEMPERATURE = 0.5
# A waiting prompt whose next full blocks this step computes for another (the same system prompt, n
# copies of one prompt) waits a step for them when they are all its uncached blocks or at least this many
IN_BATCH_SHARE_BLOCKS = 2


class Engine:
    def __init__(self, package: ModelPackage, backend, *, num_blocks: int | None = None,
                 kv_memory: int | None = None, block_size: int | None = None, max_num_seqs: int = 64,
                 max_batch_tokens: int = 512, tokenizer: Tokenizer | None = None,
                 enable_prefix_cache: bool = True, speculative_tokens: int = SPECULATIVE_TOKENS,
                 speculative_max_batch: int = SPECULATIVE_MAX_BATCH, ngram: tuple[int, int] = (1, 3)) -> None:
        if speculative_tokens < 0 or speculative_max_batch < 0:
            raise ValueError("speculative_tokens and speculative_max_batch must be >= 0")
        PromptLookup(*ngram)  # validates the sizes up front
        self.pkg = package
        self.speculative_tokens = speculative_tokens
        self.speculative_max_batch = speculative_max_batch
        self.ngram = ngram
        self.backend = backend
        cfg = package.config
        self.max_context = int(cfg["max_positions"])
        self.vocab_size = int(cfg["vocab_size"])
        self.block_size = block_size or int(package.manifest["kv_cache"]["block_size"])
        if num_blocks is None:
            per_block = self.block_size * backend.kv_bytes_per_token(cfg)
            ceiling = max_num_seqs * -(-self.max_context // self.block_size)
            num_blocks = max(1, min((kv_memory or DEFAULT_KV_MEMORY) // per_block, ceiling))
        self.allocator = BlockAllocator(num_blocks, self.block_size, enable_prefix_cache)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max(1, max_batch_tokens)
        backend.allocate(num_blocks, self.block_size, max_num_seqs,
                         table_width(self.max_context, self.max_batch_tokens, self.block_size))
        self.tokenizer = tokenizer or Tokenizer.from_file(package.file(package.manifest["tokenizer"]["file"]),
                                                          package.manifest["tokenizer"])
        tmpl = package.chat_template
        meta = package.manifest["tokenizer"]
        self.chat_template = ChatTemplate(tmpl, meta.get("bos_token"), meta.get("eos_token")) if tmpl else None
        self.eos_ids = set(package.eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self._recent_prompt: list[bytes] = []  # prefix keys of the last finished prompt's full blocks
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._ids = itertools.count()
        self.stats = EngineStats()

    @classmethod
    def from_package(cls, path, device: str = "cpu", threads: int | None = None, verify: bool = True,
                     **kwargs) -> Engine:
        """verify: check every file's sha256 first (cached by size and mtime; see package.verify_files)."""
        from runtime.backends.native import NativeBackend

        pkg = load_package(path, verify_hashes=verify)
        return cls(pkg, NativeBackend(pkg, device=device, threads=threads), **kwargs)

    # ---- requests ----
    def encode_prompt(self, prompt=None, messages: list[dict] | None = None) -> list[int]:
        if messages is not None:
            if self.chat_template is None:
                raise RequestError("this model package has no chat template")
            text = self.chat_template.render(messages, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_bos=False)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary")
            return list(prompt)
        raise RequestError("a request needs a prompt (text or token ids) or chat messages")

    def add_request(self, prompt=None, params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        ids = self.encode_prompt(prompt, messages)
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise ContextLengthError(f"the prompt has {len(ids)} tokens; this model's context is "
                                     f"{self.max_context} tokens")
        if self.allocator.blocks_for(len(ids) + 1) > self.allocator.num_blocks:
            raise ContextLengthError(f"the prompt has {len(ids)} tokens, more than the KV cache holds "
                               f"({self.allocator.num_blocks * self.block_size} tokens)")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise RequestError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, ids, params, tokens=list(ids))
        seq.decoder = IncrementalDecoder(self.tokenizer)
        seq.stopper = StopChecker(params.stop, params.include_stop_str_in_output)
        seq.rng = make_rng(params.seed)
        if params.penalized:
            seq.penalties = PenaltyState()
            seq.penalties.add_prompt(ids)
            seq.penalties.add_bias(params.logit_bias)
        self.seqs[rid] = seq
        self.waiting.append(seq)
        return rid

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq)
        self.stats.aborted += 1
        return True

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix (as vLLM's reset_prefix_cache): later prompts compute from scratch.
        Running sequences keep their blocks. Returns the number of cached blocks forgotten."""
        self._recent_prompt = []
        return self.allocator.reset()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- KV bookkeeping ----
    def _release(self, seq: Sequence) -> None:
        for b in seq.blocks:
            self.allocator.release(b)
        seq.blocks = []
        seq.block_keys = []
        seq.num_computed = 0
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
            seq.slot = -1

    def _finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        full = len(seq.prompt_ids) // self.block_size
        if full and len(seq.block_keys) >= full:
            self._recent_prompt = seq.block_keys[:full]
        self._release(seq)
        self.seqs.pop(seq.id, None)

    def _grow(self, seq: Sequence, upto_tokens: int) -> bool:
        need = self.allocator.blocks_for(upto_tokens) - len(seq.blocks)
        if need > self.allocator.num_free:
            return False
        for _ in range(need):
            block = self.allocator.allocate()
            self.backend.set_block(seq.slot, len(seq.blocks), block)
            seq.blocks.append(block)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV; it will recompute prompt + generated tokens later."""
        self.running.remove(seq)
        self._release(seq)
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    # ---- scheduling ----
    def _schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_batch_tokens
        plan: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running:  # preempted below to make room
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            seq.draft = self._draft(seq, budget - n) if n == 1 == len(seq.tokens) - seq.num_computed else []
            n += len(seq.draft)
            plan.append((seq, n))
            budget -= n
        # prefix keys of the prompt blocks this step's chunks complete: a waiting prompt that starts with
        # them waits a step and then reads them from the cache instead of computing them again
        sharing = self.allocator.enable_prefix_cache and bool(self.waiting)
        pending: set[bytes] = set()
        if sharing:
            for seq, n in plan:
                if seq.num_computed < len(seq.prompt_ids):
                    pending.update(self._chunk_keys(seq, seq.block_keys, seq.num_computed + n))
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            keys = self._prefix_keys(seq)
            if pending and self._waits_for(keys, pending):
                continue
            cached = self.allocator.lookup(keys)
            seq.block_keys = keys[:len(cached)]  # a copy: _publish_blocks appends to it
            start = len(cached) * self.block_size
            n = min(len(seq.tokens) - start, budget)
            if self.allocator.blocks_for(start + n) - len(cached) > self.allocator.num_free:
                for block in cached:  # not admitted after all: give the hits back
                    self.allocator.release(block)
                break
            self.waiting.remove(seq)
            seq.prefix_keys = None
            seq.draft = []
            seq.slot = self._free_slots.pop()
            for block in cached:
                self.backend.set_block(seq.slot, len(seq.blocks), block)
                seq.blocks.append(block)
            seq.num_computed = start
            if seq.num_generated == 0:
                seq.cached_tokens = start
                self.stats.cached_prompt_tokens += start
            self._grow(seq, start + n)
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
            if sharing:
                pending.update(keys[len(cached):(start + n) // self.block_size])
        return plan

    def _waits_for(self, keys: list[bytes], pending: set[bytes]) -> bool:
        """Whether a waiting prompt should let this step's chunks compute its next blocks first: they
        cover all its uncached full blocks, or at least IN_BATCH_SHARE_BLOCKS of them. It then waits
        one step (vLLM defers the same way where a step cannot read blocks it is writing): here a row
        attends to its own context only, so blocks computed in a step are shared from the next one."""
        first = 0
        while first < len(keys) and self.allocator.cached_block(keys[first]) is not None:
            first += 1
        shared = 0
        while first + shared < len(keys) and keys[first + shared] in pending:
            shared += 1
        return shared > 0 and (shared >= IN_BATCH_SHARE_BLOCKS or first + shared == len(keys))

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Tokens to verify after a decode step's real one, with KV room for them; [] when not worth it.

        Each drafted position gets its own logits row (with penalties counting the drafts before it as
        generated), and finish_step chooses row by row, as plain decoding would, while the choice equals
        the draft. A sampled request draws once per emitted token either way, so even a seeded sample is
        the same with or without drafts; above SPECULATIVE_MAX_TEMPERATURE drafts rarely pay.
        """
        p = seq.params
        if (not self.speculative_tokens or len(self.running) > self.speculative_max_batch
                or p.temperature > SPECULATIVE_MAX_TEMPERATURE):
            return []
        k = min(self.speculative_tokens, budget, p.max_tokens - seq.num_generated - 1,
                self.max_context - len(seq.tokens) - 1)
        if k <= 0:
            return []
        if seq.lookup is None:
            seq.lookup = PromptLookup(*self.ngram)
        draft = seq.lookup.draft(seq.tokens, k)
        if not draft:
            return []
        need = self.allocator.blocks_for(len(seq.tokens) + len(draft)) - len(seq.blocks)
        if need > 0 and self.allocator.num_free - need < len(self.running):
            return []  # keep a block per running sequence for its real token: never preempt for a guess
        self._grow(seq, len(seq.tokens) + len(draft))
        self.stats.draft_tokens += len(draft)
        return draft

    # ---- a prompt's cached blocks outside the engine (the page keeps them across reloads) ----
    def recent_prompt_blocks(self, max_blocks: int) -> list[tuple[bytes, int]]:
        """(key, block) of the last finished request's full prompt blocks that are still cached, in
        order: what a backend can save, to restore() after a restart with the same package."""
        out = []
        for key in self._recent_prompt[:max_blocks]:
            block = self.allocator.cached_block(key)
            if block is None:
                break
            out.append((key, block))
        return out

    def restore_prompt_blocks(self, keys: list[bytes]) -> list[int]:
        """Cache blocks under these chained keys (a prefix, in order) for K/V the backend is about to
        write into them; returns their blocks, fewer when the pool has no free block left."""
        blocks = []
        for key in keys:
            block = self.allocator.restore(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def forget_prompt_blocks(self, blocks: list[int]) -> None:
        """Undo restore_prompt_blocks when the backend could not write their K/V."""
        for block in blocks:
            self.allocator.forget(block)

    def _prefix_keys(self, seq: Sequence) -> list[bytes]:
        """Chained prefix keys of the sequence's full blocks, leaving at least one token to compute;
        kept while it waits (its tokens change only by preemption, which appends)."""
        if not self.allocator.enable_prefix_cache:
            return []
        if seq.prefix_keys is None or seq.prefix_keys[0] != len(seq.tokens):
            seq.prefix_keys = (len(seq.tokens), self._chunk_keys(seq, [], len(seq.tokens) - 1))
        return seq.prefix_keys[1]

    def _chunk_keys(self, seq: Sequence, known: list[bytes], upto_tokens: int) -> list[bytes]:
        """Keys of the full blocks within the first upto_tokens tokens, after the `known` ones."""
        bs, keys = self.block_size, []
        parent = known[-1] if known else None
        for j in range(len(known), upto_tokens // bs):
            parent = block_key(parent, seq.tokens[j * bs:(j + 1) * bs], seq.adapter)
            keys.append(parent)
        return keys

    def _publish_blocks(self, seq: Sequence) -> None:
        """Register every block the sequence has just completed in the prefix cache."""
        for key in self._chunk_keys(seq, seq.block_keys, seq.num_computed):
            self.allocator.register(seq.blocks[len(seq.block_keys)], key)
            seq.block_keys.append(key)

    def step(self) -> list[RequestOutput]:
        prepared = self.prepare_step()
        if prepared is None:
            return []
        return self.finish_step(prepared, self.backend.run(prepared.batch))

    def prepare_step(self) -> PreparedStep | None:
        """Schedule the next step and build its batch; None when there is nothing to run.

        prepare_step / backend / finish_step is what step() does; the split lets an asynchronous
        backend (onnxruntime-web) be awaited in between, with requests added or aborted meanwhile.
        """
        plan = self._schedule()
        if not plan:
            return None
        bs = self.block_size
        chunks = []
        for seq, n in plan:
            start = seq.num_computed
            p = seq.params
            draft = seq.draft
            tokens = seq.tokens[start:start + n - len(draft)] + draft
            chunks.append(Chunk(
                slot=seq.slot, tokens=tokens, start=start, num_blocks=len(seq.blocks),
                kv_slots=[seq.blocks[t // bs] * bs + t % bs for t in range(start, start + n)],
                want_logits=start + n - len(draft) == len(seq.tokens), logits_rows=1 + len(draft),
                temperature=1.0 if p.greedy else p.temperature,
                repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, penalties=seq.penalties,
                top_k=p.candidates(self.vocab_size)))
        return PreparedStep(plan, chunks, build_step(chunks, bs))

    def finish_step(self, prepared: PreparedStep, result) -> list[RequestOutput]:
        """Account the step's computed tokens and sample from its candidates."""
        self.stats.steps += 1
        self.stats.peak_running = max(self.stats.peak_running, len(prepared.chunks))
        outputs: list[RequestOutput] = []
        rows = iter(zip(result.topk_ids, result.topk_logprobs))  # per chunk that wanted logits, in order
        for (seq, n), chunk in zip(prepared.plan, prepared.chunks):
            candidates = [next(rows) for _ in range(chunk.logits_rows)] if chunk.want_logits else []
            if self.seqs.get(seq.id) is not seq:  # aborted while the step ran: its blocks are gone already
                continue
            draft = chunk.tokens[len(chunk.tokens) - chunk.logits_rows + 1:]
            seq.num_computed += n - len(draft)
            if seq.num_generated == 0:
                self.stats.prompt_tokens += n
            accepted = 0
            for j, row in enumerate(candidates):
                if self.allocator.enable_prefix_cache:  # before _accept, which may finish and release it
                    self._publish_blocks(seq)
                out = self._accept(seq, *row)
                outputs.append(out)
                if out.finished or j == len(draft) or out.token_ids[0] != draft[j]:
                    break
                seq.num_computed += 1  # the drafted token was the one chosen: its K/V from this step hold
                accepted += 1
            if draft:
                seq.lookup.record(len(draft), accepted)
                self.stats.accepted_draft_tokens += accepted
            if not candidates and self.allocator.enable_prefix_cache:
                self._publish_blocks(seq)
        return outputs

    def _accept(self, seq: Sequence, ids: list[int], lps: list[float]) -> RequestOutput:
        p = seq.params
        token = choose(ids, lps, p, seq.rng)
        seq.tokens.append(token)
        self.stats.generated_tokens += 1
        if seq.penalties is not None:
            seq.penalties.add_generated(token)
        logprobs = []
        if p.logprobs is not None:
            lp = dict(zip(ids, lps)).get(token, float("-inf"))
            logprobs.append(TokenLogprob(token, lp, list(zip(ids, lps))[: p.logprobs]))
        reason, by_string = None, False
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason, text = "stop", ""
        else:
            text, by_string = seq.stopper.feed(seq.decoder.add(token))
            reason = "stop" if by_string else None
        if reason is None and (seq.num_generated >= p.max_tokens or len(seq.tokens) >= self.max_context):
            reason = "length"
        if reason is not None:
            if not by_string:  # release text held back for a stop string that never came
                tail, hit = seq.stopper.feed(seq.decoder.flush())
                text += tail if hit else tail + seq.stopper.flush()
            self._finish(seq)
        return RequestOutput(seq.id, text, [token], reason is not None, reason, len(seq.prompt_ids),
                             seq.num_generated, logprobs, cached_tokens=seq.cached_tokens)

    def stats_snapshot(self) -> dict:
        a = self.allocator
        elapsed = max(1e-9, time.monotonic() - self.stats.started)
        return {
            "running": len(self.running), "waiting": len(self.waiting),
            "kv_blocks_total": a.num_blocks, "kv_blocks_used": a.num_used, "kv_blocks_free": a.num_free,
            "kv_block_size": self.block_size, "prefix_cache_blocks": a.num_cached,
            "prefix_cache_queries": a.stats.queries, "prefix_cache_hits": a.stats.hits,
            "prefix_cache_hit_rate": round(a.stats.hit_rate, 4), "prefix_cache_evictions": a.stats.evictions,
            "prompt_tokens": self.stats.prompt_tokens, "cached_prompt_tokens": self.stats.cached_prompt_tokens,
            "generated_tokens": self.stats.generated_tokens, "steps": self.stats.steps,
            "preemptions": self.stats.preemptions, "aborted": self.stats.aborted,
            "peak_running": self.stats.peak_running,
            "draft_tokens": self.stats.draft_tokens, "accepted_draft_tokens": self.stats.accepted_draft_tokens,
            "generated_tokens_per_s": round(self.stats.generated_tokens / elapsed, 2),
        }

    # ---- convenience ----
    def generate(self, prompt=None, params: SamplingParams | None = None, *, messages=None):
        """Run one request to completion, yielding its outputs (other queued requests run too)."""
        rid = self.add_request(prompt, params, messages=messages)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return
            if rid not in self.seqs:
                return
