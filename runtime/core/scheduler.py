"""Decides each step: which sequences run, how many of their tokens, in which KV blocks.

FCFS with a per-step token budget: running sequences first (decodes, then unfinished prompt chunks),
then waiting ones admitted while KV blocks last; a waiting prompt whose next blocks this step
computes for another waits a step and takes them from the prefix cache. When the pool runs out,
the newest running sequence is preempted and later recomputed. Greedy and low-temperature decodes
may carry prompt-lookup drafts (runtime/core/speculative.py) for the step to verify. On a backend whose
attention pads every row to the step's longest (`pads_rows`: the exported graph's own attention), a step's
cost is rows x its longest chunk, so each row's chunk is capped at the budget over the rows that may run:
many streams take a long prompt in smaller chunks instead of padding every decode row to its length.

The scheduler owns the block allocator and the prefix cache, and hands the backend each
sequence's block table in the step's chunks; it never touches a model, so it is tested alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from runtime.core.adapters import AdapterSlots
from runtime.core.config import SPECULATIVE_MAX_TEMPERATURE, EngineConfig
from runtime.core.kv_blocks import BlockAllocator, exact_floor, prefix_keys
from runtime.core.sequence import Sequence
from runtime.core.speculative import PromptLookup
from runtime.core.stats import EngineStats
from runtime.core.step_batch import Chunk

# prompt rows scored in one step (prompt_logprobs): each fetches [vocab] logits (262,144 floats for Gemma 3);
# onnxruntime grows its buffers slowly for many such rows (Gemma 3: 6.7 s at 89 rows the first time, 2.3 at 32)
SCORED_ROWS = 32
# A waiting prompt whose next full blocks this step computes for another (the same system prompt, n
# copies of one prompt) waits a step for them when they are all its uncached blocks or at least this many
IN_BATCH_SHARE_BLOCKS = 2
SCALING_PASS = "/scaling-pass"  # X-LoRA: its scaling pass's blocks chain under the X-LoRA id and this


@dataclass
class SchedulerOutput:
    """One step's decision: the sequences that run, with what each computes (drafts included)."""

    scheduled: list[tuple[Sequence, int]]  # (sequence, tokens computed this step)
    chunks: list[Chunk]  # the same order: tokens, positions, block table, KV slots, logits rows
    dropped_blocks: list[int]  # blocks no sequence holds since the last step (BlockAllocator.take_dropped)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, block_size: int, max_context: int, vocab_size: int,
                 stats: EngineStats | None = None, exact_blocks: int = 1, pads_rows: bool = False) -> None:
        self._scored_left = SCORED_ROWS  # this step's (schedule() resets it)
        self._long_cap, self._long_left = 0, 1  # this step's long-prompt limit and turns left (_prompt_limit)
        self.config = config
        self.pads_rows = pads_rows  # Backend.pads_rows: a step's attention costs rows x its longest chunk
        # blocks up to a query's own that the backend's pool reads exact (Backend.kv_exact_blocks): above
        # one, each sequence gets a floor (kv_blocks.exact_floor), and only blocks below it are shared
        self.exact_blocks = exact_blocks
        self.block_size = block_size
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.allocator = BlockAllocator(num_blocks, block_size, config.enable_prefix_cache)
        self.stats = stats or EngineStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self.slots = AdapterSlots(config.max_loras)  # which adapter each of the LoRA graph's slots holds
        self._recent_prompt: list[bytes] = []  # prefix keys of the last finished prompt's full blocks
        self.recent_tokens: tuple[list[int], str | None] = ([], None)  # the last finished one's computed tokens, adapter

    # ---- requests ----
    def add(self, seq: Sequence) -> None:
        self.seqs[seq.id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq)
        self.stats.aborted += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished (or aborted) sequence and give back its blocks; its full prompt blocks stay
        cached and are remembered as the most recent prompt."""
        if seq in self.running:
            self.running.remove(seq)
        full = len(seq.prompt_ids) // self.block_size
        if full and len(seq.block_keys) >= full and not seq.xlora:  # (its real pass alone would not serve)
            self._recent_prompt = seq.block_keys[:full]
        if not seq.xlora:
            self.recent_tokens = (seq.tokens[:seq.num_computed], seq.adapter)  # a copy
        self._release(seq)
        seq.finished = True
        self.seqs.pop(seq.id, None)

    # ---- the step ----
    def schedule(self) -> SchedulerOutput | None:
        """The next step, or None when nothing can run."""
        budget = self.config.max_batch_tokens
        cap = self._row_cap()
        self._scored_left = SCORED_ROWS
        plan: list[tuple[Sequence, int]] = []
        decoding = any(len(s.tokens) - s.num_computed <= 1 for s in self.running)
        self._long_cap, self._long_left = self.config.long_prefill_tokens if decoding else 0, 1
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running:  # preempted below to make room
                continue
            left = len(seq.tokens) - seq.num_computed
            limit = self._prompt_limit(left) if left > 1 else 1  # a prompt, or a preempted one's recompute
            if limit <= 0:
                continue
            n = self._scored(seq, min(left, budget, cap, limit))
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            seq.draft = self._draft(seq, min(budget, cap) - n) if n == 1 == len(seq.tokens) - seq.num_computed else []
            n += len(seq.draft)
            plan.append((seq, n))
            budget -= n
        self._admit(plan, budget, cap)
        if not plan:
            return None
        for seq, n in plan:
            if seq.num_generated == 0:
                self.stats.prompt_tokens += n
        self.stats.peak_running = max(self.stats.peak_running, len(plan))
        return SchedulerOutput(plan, [self._chunk(seq, n) for seq, n in plan], self.allocator.take_dropped())

    def _prompt_limit(self, left: int) -> int:
        """The most tokens of a prompt with `left` to compute this step. While some sequence decodes, a prompt
        longer than long_prefill_tokens computes that many, and only one such prompt a step (vLLM's
        long_prefill_token_threshold with max_long_partial_prefills 1); a shorter one computes whole. So a
        document's prefill adds at most long_prefill_tokens to the streams' steps, and a chat's prompt does not
        queue behind it. Call in the step's order: the long prompt's turn is taken by the first that asks."""
        if not self._long_cap or left <= self._long_cap:
            return left
        if self._long_left <= 0:
            return 0
        self._long_left -= 1
        return self._long_cap

    def _scored(self, seq: Sequence, n: int) -> int:
        """n, or for a prompt being scored (prompt_logprobs) what is left of the step's SCORED_ROWS (at least one):
        each of its rows fetches the whole vocabulary's logits."""
        if not seq.scores_prompt:
            return n
        n = max(1, min(n, self._scored_left))
        self._scored_left -= n
        return n

    def _row_cap(self) -> int:
        """The most tokens one row may compute this step: the budget, or on a backend that pads rows, the
        budget over the rows this step may hold (so rows x the longest chunk stays within it)."""
        budget = self.config.max_batch_tokens
        if not self.pads_rows:
            return budget
        rows = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return max(1, budget // max(1, rows))

    def _admit(self, plan: list[tuple[Sequence, int]], budget: int, cap: int) -> None:
        # prefix keys of the prompt blocks this step's chunks complete: a waiting prompt that starts with
        # them waits a step and then reads them from the cache instead of computing them again
        sharing = self.allocator.enable_prefix_cache and bool(self.waiting)
        pending: set[bytes] = set()
        if sharing:
            for seq, n in plan:
                if seq.num_computed < len(seq.prompt_ids) and not seq.xlora:
                    pending.update(self._chunk_keys(seq, seq.block_keys, min(seq.num_computed + n, self._shareable(seq))))
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            keys, shadow_keys = self._prefix_keys(seq)
            if pending and not seq.xlora and self._waits_for(keys, pending):
                continue
            slots = self._acquire_slots(seq)
            if slots is None:  # every adapter slot is taken by running sequences of other adapters
                continue
            cached = [] if seq.scores_prompt else self.allocator.lookup(keys)  # a scored prompt computes every row
            shadow = []
            if seq.xlora:  # a prefix serves only with both passes' K/V: the shorter run of hits decides
                shadow = self.allocator.lookup(shadow_keys[:len(cached)])
                for block in cached[len(shadow):]:
                    self.allocator.release(block)
                cached = cached[:len(shadow)]
            seq.block_keys = keys[:len(cached)]  # copies: update() appends to them
            seq.shadow_keys = shadow_keys[:len(shadow)]
            start = len(cached) * self.block_size
            limit = self._prompt_limit(len(seq.tokens) - start)
            if limit <= 0:  # a second long prompt: it waits, the short ones behind it go on
                self._give_back(cached + shadow, slots)
                continue
            n = self._scored(seq, min(len(seq.tokens) - start, budget, cap, limit))
            if seq.kv_passes * (self.allocator.blocks_for(start + n) - len(cached)) > self.allocator.num_free:
                self._give_back(cached + shadow, slots)  # not admitted after all
                break
            if seq.xlora:
                seq.adapter_slot, seq.expert_slots = 0, slots
            else:
                seq.adapter_slot = slots[0]
            self.waiting.remove(seq)
            seq.prefix_keys = None
            seq.draft = []
            seq.blocks = list(cached)
            seq.shadow_blocks = list(shadow)
            seq.num_computed = seq.computed_from = start
            if seq.num_generated == 0:
                seq.cached_tokens = start
                self.stats.cached_prompt_tokens += start
            self._grow(seq, start + n)
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
            if sharing and not seq.xlora:
                pending.update(keys[len(cached):(start + n) // self.block_size])

    def _give_back(self, blocks: list[int], slots: list[int]) -> None:
        """A waiting sequence's cache hits and adapter slots, taken for an admission that did not happen."""
        for block in blocks:
            self.allocator.release(block)
        for slot in slots:
            self.slots.release(slot)

    def _acquire_slots(self, seq: Sequence) -> list[int] | None:
        """The adapter slot of the sequence's adapter, or its X-LoRA experts' slots; None when one is busy."""
        if not seq.xlora:
            slot = self.slots.acquire(seq.adapter)
            return None if slot is None else [slot]
        got: list[int] = []
        for expert in seq.xlora.experts:
            slot = self.slots.acquire(expert.id)
            if slot is None:
                for s in got:
                    self.slots.release(s)
                return None
            got.append(slot)
        return got

    def _chunk(self, seq: Sequence, n: int) -> Chunk:
        bs, start, p, draft = self.block_size, seq.num_computed, seq.params, seq.draft
        chunk = Chunk(
            tokens=seq.tokens[start:start + n - len(draft)] + draft, start=start, block_table=seq.blocks,
            kv_slots=[seq.blocks[t // bs] * bs + t % bs for t in range(start, start + n)],
            want_logits=start + n - len(draft) == len(seq.tokens), logits_rows=1 + len(draft), exact_from=self._floor(seq),
            own_from=seq.computed_from,
            temperature=p.logits_temperature,
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, penalties=seq.penalties, top_k=p.candidates(self.vocab_size),
            adapter_slot=seq.adapter_slot)
        if chunk.want_logits:
            chunk.matcher = seq.matcher
        if seq.scores_prompt:  # the chunk's positions before the prompt's last score the prompt's next token
            upto = min(start + n, len(seq.prompt_ids) - 1)
            if upto > start:
                chunk.scored, chunk.score_ids = upto - start, seq.tokens[start + 1:upto + 1]
                chunk.top_k = max(chunk.top_k, p.prompt_logprobs)
        if seq.xlora:
            chunk.xlora, chunk.expert_slots, chunk.shadow_table = seq.xlora, seq.expert_slots, seq.shadow_blocks
            chunk.shadow_kv_slots = [seq.shadow_blocks[t // bs] * bs + t % bs for t in range(start, start + n)]
        return chunk

    def update(self, seq: Sequence, computed: int, accepted_drafts: int, finished: bool) -> None:
        """After the step: `computed` of the sequence's tokens now have K/V (its accepted drafts
        included); publish the blocks they completed, and finish the sequence if it is done."""
        seq.num_computed += computed
        if seq.draft:
            seq.lookup.record(len(seq.draft), accepted_drafts)
            self.stats.accepted_draft_tokens += accepted_drafts
        if self.allocator.enable_prefix_cache:
            upto = min(seq.num_computed, self._shareable(seq))
            for key in self._chunk_keys(seq, seq.block_keys, upto):
                self.allocator.register(seq.blocks[len(seq.block_keys)], key)
                seq.block_keys.append(key)
            if seq.xlora:  # the scaling pass's blocks, on a chain of their own
                for key in self._chunk_keys(seq, seq.shadow_keys, upto, SCALING_PASS):
                    self.allocator.register(seq.shadow_blocks[len(seq.shadow_keys)], key)
                    seq.shadow_keys.append(key)
        if finished:
            self.finish(seq)

    # ---- KV blocks ----
    def _release(self, seq: Sequence) -> None:
        for b in seq.blocks + seq.shadow_blocks:
            self.allocator.release(b)
        seq.blocks = []
        seq.shadow_blocks = []
        seq.block_keys = []
        seq.shadow_keys = []
        seq.num_computed = 0
        if seq.adapter_slot >= 0:
            self.slots.release(seq.adapter_slot)
            seq.adapter_slot = -1
        for slot in seq.expert_slots:
            self.slots.release(slot)
        seq.expert_slots = []

    def _grow(self, seq: Sequence, upto_tokens: int) -> bool:
        need = self.allocator.blocks_for(upto_tokens) - len(seq.blocks)
        if seq.kv_passes * need > self.allocator.num_free:
            return False
        for _ in range(need):
            seq.blocks.append(self.allocator.allocate())
            if seq.xlora:
                seq.shadow_blocks.append(self.allocator.allocate())
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV; it will recompute prompt + generated tokens later."""
        self.running.remove(seq)
        self._release(seq)
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Tokens to verify after a decode step's real one, with KV room for them; [] when not worth it.

        Each drafted position gets its own logits row (with penalties counting the drafts before it as
        generated), and the output processor chooses row by row, as plain decoding would, while the choice
        equals the draft. A sampled request draws once per emitted token either way, so even a seeded
        sample is the same with or without drafts; above SPECULATIVE_MAX_TEMPERATURE drafts rarely pay.
        """
        p, cfg = seq.params, self.config
        if (not cfg.speculative_tokens or seq.matcher or len(self.running) > cfg.speculative_max_batch
                or p.temperature > SPECULATIVE_MAX_TEMPERATURE):
            return []
        k = min(cfg.speculative_tokens, budget, p.max_tokens - seq.num_generated - 1,
                self.max_context - len(seq.tokens) - 1)
        if k <= 0:
            return []
        if seq.lookup is None:
            seq.lookup = PromptLookup(*cfg.ngram)
        draft = seq.lookup.draft(seq.tokens, k)
        if not draft:
            return []
        need = self.allocator.blocks_for(len(seq.tokens) + len(draft)) - len(seq.blocks)
        if need > 0 and self.allocator.num_free - need < len(self.running):
            return []  # keep a block per running sequence for its real token: never preempt for a guess
        self._grow(seq, len(seq.tokens) + len(draft))
        self.stats.draft_tokens += len(draft)
        return draft

    # ---- the prefix cache ----
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

    def _prefix_keys(self, seq: Sequence) -> tuple[list[bytes], list[bytes]]:
        """Chained prefix keys of the sequence's full blocks, leaving at least one token to compute, and
        (X-LoRA) those of its scaling pass's blocks; kept while it waits (its tokens change only by
        preemption, which appends)."""
        if not self.allocator.enable_prefix_cache:
            return [], []
        if seq.prefix_keys is None or seq.prefix_keys[0] != len(seq.tokens):
            upto = len(seq.tokens) - 1
            if self.exact_blocks > 1:  # a hit must end where the new request reads its own block alone
                upto = min(upto, self._floor(seq))
            shadow = self._chunk_keys(seq, [], upto, SCALING_PASS) if seq.xlora else []
            seq.prefix_keys = (len(seq.tokens), self._chunk_keys(seq, [], upto), shadow)
        return seq.prefix_keys[1], seq.prefix_keys[2]

    def _floor(self, seq: Sequence) -> int:
        """The first position before a query's own block that the sequence may read exact (0: no limit)."""
        return exact_floor(len(seq.prompt_ids), self.block_size) if self.exact_blocks > 1 else 0

    def _shareable(self, seq: Sequence) -> int:
        """Tokens of the sequence whose blocks others may share: on a pool reading blocks before a query's
        own exact, those of the blocks up to its floor's (computed as any request computes them)."""
        return self._floor(seq) + self.block_size if self.exact_blocks > 1 else len(seq.tokens)

    def _chunk_keys(self, seq: Sequence, known: list[bytes], upto_tokens: int, pass_tag: str = "") -> list[bytes]:
        """Keys of the full blocks within the first upto_tokens tokens, after the `known` ones. An X-LoRA's
        real pass is keyed by its id (its experts, classifier and settings), its scaling pass by that id
        and pass_tag: each pass's K/V is a function of the tokens before it and the X-LoRA alone."""
        adapter = seq.adapter + pass_tag if pass_tag and seq.adapter else seq.adapter
        return prefix_keys(seq.tokens, self.block_size, adapter, known, upto_tokens)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix (as vLLM's reset_prefix_cache): later prompts compute from scratch.
        Running sequences keep their blocks. Returns the number of cached blocks forgotten."""
        self._recent_prompt = []
        return self.allocator.reset()

    # a prompt's cached blocks outside the engine (the page keeps them across reloads)
    def recent_prompt_blocks(self, max_blocks: int) -> list[tuple[bytes, int]]:
        """(key, block) of the last finished request's full prompt blocks that are still cached, in
        order: what a backend can save, to restore after a restart with the same package."""
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

    def cached_run(self, tokens: list[int], adapter: str | None = None) -> list[tuple[bytes, int]]:
        """(key, block) of the cached full blocks that begin `tokens`, in order, to the first one not cached
        (a saved session's blocks: runtime/core/kv_sessions.py)."""
        out = []
        for key in prefix_keys(tokens, self.block_size, adapter):
            block = self.allocator.cached_block(key)
            if block is None:
                break
            out.append((key, block))
        return out

    def park_blocks(self, tokens: list[int], adapter: str | None = None) -> list[tuple[int, int]]:
        """Cache blocks under the prefix keys of `tokens`' full blocks, for K/V the backend is about to write:
        (index of the block in `tokens`, pool block) of those not cached already. Blocks nobody holds may be
        evicted for them, never those of running sequences or of this prefix; fewer when the pool runs out."""
        keys = prefix_keys(tokens, self.block_size, adapter)
        held = [b for b in map(self.allocator.cached_block, keys) if b is not None]
        for block in held:  # kept while the others are parked: an eviction would break the chain
            self.allocator.retain(block)
        out, room = [], self.allocator.num_free  # parked blocks stay free to take: count them off
        for j, key in enumerate(keys):
            if self.allocator.cached_block(key) is not None:
                continue
            if len(out) == room:
                break
            block = self.allocator.restore(key, evict=True)
            if block is None:
                break
            out.append((j, block))
        for block in held:
            self.allocator.release(block)
        return out

    def forget_prompt_blocks(self, blocks: list[int]) -> None:
        """Undo restore_prompt_blocks when the backend could not write their K/V."""
        for block in blocks:
            self.allocator.forget(block)
