"""Turns one step's scheduled chunks into the graph's flat inputs, as plain Python lists.

Everything here is O(tokens in the step) plus the step's block tables, which the scheduler hands
over in the chunks (the backend keeps no table of its own); penalty state is kept incrementally
per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime import contract as C


@dataclass
class PenaltyState:
    """Token ids a sequence has seen, with generation counts, kept in insertion order."""

    ids: list[int] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    bias: list[float] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)

    def _slot(self, token: int) -> int:
        i = self.index.get(token)
        if i is None:
            i = self.index[token] = len(self.ids)
            self.ids.append(token)
            self.seen.append(0.0)
            self.counts.append(0.0)
            self.bias.append(0.0)
        return i

    def add_prompt(self, tokens: list[int]) -> None:
        for t in tokens:
            self.seen[self._slot(t)] = 1.0

    def add_generated(self, token: int) -> None:
        i = self._slot(token)
        self.seen[i] = 1.0
        self.counts[i] += 1.0

    def add_bias(self, bias: dict[int, float]) -> None:
        for t, v in bias.items():
            self.bias[self._slot(int(t))] = float(v)

    def after(self, generated: list[int]) -> PenaltyState:
        """A copy with `generated` added: the state at a drafted position, where the drafts before it
        count as generated."""
        out = PenaltyState(list(self.ids), list(self.seen), list(self.counts), list(self.bias), dict(self.index))
        for t in generated:
            out.add_generated(t)
        return out


@dataclass
class Chunk:
    """One sequence's share of a step."""

    tokens: list[int]
    start: int  # position of tokens[0]
    block_table: list[int]  # the sequence's KV blocks after this step, in order
    kv_slots: list[int]  # pool slot (block * block_size + offset) of each new token
    want_logits: bool
    logits_rows: int = 1  # with want_logits: how many trailing tokens want next-token logits (drafts + 1)
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalties: PenaltyState | None = None
    top_k: int = 1
    adapter_slot: int = 0  # the LoRA graph's adapter slot of the sequence (0: the base model)
    xlora: object = None  # X-LoRA (runtime.core.xlora.XLoraInfo): a scaling pass first, on shadow blocks
    expert_slots: list[int] | None = None  # X-LoRA: its experts' slots, in the classifier's order
    shadow_table: list[int] | None = None  # X-LoRA: the scaling pass's block table
    shadow_kv_slots: list[int] | None = None  # X-LoRA: the scaling pass's pool slot per new token
    matcher: object = None  # structured output (runtime.core.constraints.Matcher): masks its logits row
    exact_from: int = 0  # two-tier pools: the sequence's floor (kv_blocks.exact_floor)
    own_from: int = 0  # the first position the sequence computed itself: blocks before it are prefix-cache hits
    # prompt_logprobs: how many leading tokens are scored, each row's logits at temperature 1 and unprocessed, and
    # the token each row scores (the prompt's next); these rows come before the chunk's own logits rows
    scored: int = 0
    score_ids: list[int] | None = None


@dataclass
class XLoraGroup:
    """One X-LoRA chunk's tokens in the scaling pass and in the step."""

    xlora: object  # runtime.core.xlora.XLoraInfo
    expert_slots: list[int]
    scaling_start: int  # its first token in the scaling pass's batch
    step_start: int  # its first token in the step's batch
    n: int


@dataclass
class XLoraPass:
    """What a step with X-LoRA chunks runs first: those chunks on their shadow blocks, no logits rows;
    the classifier reads its last hidden states and weighs each token's experts in the step."""

    batch: StepBatch
    groups: list[XLoraGroup]


@dataclass
class StepBatch:
    input_ids: list[int]
    position_ids: list[int]
    query_index: list[list[int]]
    flat_index: list[int]
    block_tables: list[list[int]]  # [batch, max_blocks], rows padded with block 0
    max_blocks: int
    kv_slots: list[int]
    logits_index: list[int]
    temperature: list[float]
    repetition_penalty: list[float]
    presence_penalty: list[float]
    frequency_penalty: list[float]
    sparse_ids: list[list[int]]
    sparse_seen: list[list[float]]
    sparse_counts: list[list[float]]
    sparse_bias: list[list[float]]
    top_k: int
    want_full_logits: bool = False
    adapter_slots: list[int] | None = None  # per token, when any sequence runs on an adapter (the LoRA graph)
    xlora: XLoraPass | None = None  # the scaling pass, when X-LoRA sequences run
    matchers: list | None = None  # per logits row, its matcher or None, when any row is constrained
    dropped_blocks: list[int] = field(default_factory=list)  # blocks no sequence holds since the last step
    exact_from: list[int] = field(default_factory=list)  # per row: its floor (Chunk.exact_from; build_step fills it)
    own_from: list[int] = field(default_factory=list)  # per row: Chunk.own_from (build_step fills it)
    # per logits row, the token whose log-probability the backend reports in StepResult.scores (-1: none);
    # None when no row scores a prompt
    score_ids: list[int] | None = None

    def lora_slots(self) -> list[int]:
        """Every adapter slot the step reads: the tokens' own and the X-LoRA experts'."""
        slots = list(self.adapter_slots or [0])
        for g in self.xlora.groups if self.xlora else []:
            slots.extend(g.expert_slots)
        return slots

    def feeds(self, top_k: int) -> dict[str, tuple[list, list[int]]]:
        """Every per-step graph input (runtime.contract.STEP_INPUTS) as (values, dims): values nested as
        the rank says, dims given explicitly so that an empty input keeps its rank (a step of prompt
        chunks only has no logits rows, and its sparse inputs are [0, 1])."""
        rows = len(self.logits_index)
        sparse = [rows, len(self.sparse_ids[0]) if rows else 1]
        feeds = {
            C.INPUT_IDS: (self.input_ids, [len(self.input_ids)]),
            C.POSITION_IDS: (self.position_ids, [len(self.position_ids)]),
            C.QUERY_INDEX: (self.query_index, [len(self.query_index), len(self.query_index[0])]),
            C.FLAT_INDEX: (self.flat_index, [len(self.flat_index)]),
            C.BLOCK_TABLES: (self.block_tables, [len(self.block_tables), self.max_blocks]),
            C.LOGITS_INDEX: (self.logits_index, [rows]),
            C.TEMPERATURE: (self.temperature, [rows]),
            C.REPETITION_PENALTY: (self.repetition_penalty, [rows]),
            C.PRESENCE_PENALTY: (self.presence_penalty, [rows]),
            C.FREQUENCY_PENALTY: (self.frequency_penalty, [rows]),
            C.SPARSE_IDS: (self.sparse_ids, sparse),
            C.SPARSE_SEEN: (self.sparse_seen, sparse),
            C.SPARSE_COUNTS: (self.sparse_counts, sparse),
            C.SPARSE_BIAS: (self.sparse_bias, sparse),
            C.TOP_K: ([top_k], [1]),
        }
        return feeds


# a scored prompt row's (temperature, repetition, presence, frequency): the model's own distribution
UNPROCESSED = (1.0, 1.0, 0.0, 0.0)


def build_step(chunks: list[Chunk], block_size: int, want_full_logits: bool = False) -> StepBatch:
    """The step's inputs. max_blocks covers every row's first new position + query_len: the graph
    writes each row's padded [query_len] K/V there, in its gathered context (padding past the row's
    tokens is masked)."""
    query_len = max(len(c.tokens) for c in chunks)
    ids: list[int] = []
    pos: list[int] = []
    flat: list[int] = []
    qidx: list[list[int]] = []
    kv: list[int] = []
    logits_index: list[int] = []
    # per logits row: its (temperature, repetition, presence, frequency), penalty state and matcher
    rows: list[tuple[tuple[float, float, float, float], PenaltyState | None, object]] = []
    scores: list[int] = []  # per logits row, the prompt token it scores (-1: a sampled row)
    for b, c in enumerate(chunks):
        base = len(ids)
        n = len(c.tokens)
        ids.extend(c.tokens)
        pos.extend(range(c.start, c.start + n))
        flat.extend(range(b * query_len, b * query_len + n))
        last = base + n - 1
        qidx.append(list(range(base, base + n)) + [last] * (query_len - n))
        kv.extend(c.kv_slots)
        for j in range(c.scored):  # prompt rows: scored as the model sees them, nothing applied
            logits_index.append(base + j)
            rows.append((UNPROCESSED, None, None))
            scores.append(c.score_ids[j])
        if c.want_logits:
            drafts = c.tokens[n - c.logits_rows + 1:]
            settings = (c.temperature, c.repetition_penalty, c.presence_penalty, c.frequency_penalty)
            for j in range(c.logits_rows):  # row j follows j drafted tokens: they count as generated there
                logits_index.append(last - c.logits_rows + 1 + j)
                rows.append((settings, c.penalties.after(drafts[:j]) if c.penalties and j else c.penalties, c.matcher))
                scores.append(-1)
    width = max([len(p.ids) for _, p, _ in rows if p] + [1])
    sp_ids, sp_seen, sp_counts, sp_bias = [], [], [], []
    for _, p, _ in rows:
        if p is None or not p.ids:
            sp_ids.append([0] * width)
            zeros = [0.0] * width
            sp_seen.append(zeros)
            sp_counts.append(zeros)
            sp_bias.append(zeros)
            continue
        pad = width - len(p.ids)  # pad by repeating the first entry: a duplicate scatter writes the same value
        sp_ids.append(p.ids + [p.ids[0]] * pad)
        sp_seen.append(p.seen + [p.seen[0]] * pad)
        sp_counts.append(p.counts + [p.counts[0]] * pad)
        sp_bias.append(p.bias + [p.bias[0]] * pad)
    max_blocks = max(max(len(c.block_table) for c in chunks),
                     -(-(max(c.start for c in chunks) + query_len) // block_size))
    return StepBatch(
        input_ids=ids, position_ids=pos, query_index=qidx, flat_index=flat,
        block_tables=[c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks],
        kv_slots=kv, max_blocks=max_blocks,
        logits_index=logits_index,
        temperature=[r[0][0] for r in rows], repetition_penalty=[r[0][1] for r in rows],
        presence_penalty=[r[0][2] for r in rows], frequency_penalty=[r[0][3] for r in rows],
        sparse_ids=sp_ids, sparse_seen=sp_seen, sparse_counts=sp_counts, sparse_bias=sp_bias,
        top_k=max([c.top_k for c in chunks if c.want_logits or c.scored] + [1]),
        want_full_logits=want_full_logits,
        score_ids=scores if any(t >= 0 for t in scores) else None,
        adapter_slots=([c.adapter_slot for c in chunks for _ in c.tokens]
                       if any(c.adapter_slot or c.xlora for c in chunks) else None),
        xlora=_xlora_pass(chunks, block_size),
        matchers=[m for _, _, m in rows] if any(m for _, _, m in rows) else None,
        exact_from=[c.exact_from for c in chunks],
        own_from=[c.own_from for c in chunks],
    )


def _xlora_pass(chunks: list[Chunk], block_size: int) -> XLoraPass | None:
    groups, shadows, scaling_start, step_start = [], [], 0, 0
    for c in chunks:
        if c.xlora:
            shadows.append(Chunk(c.tokens, c.start, c.shadow_table, c.shadow_kv_slots, False, exact_from=c.exact_from,
                                 own_from=c.own_from))
            groups.append(XLoraGroup(c.xlora, c.expert_slots, scaling_start, step_start, len(c.tokens)))
            scaling_start += len(c.tokens)
        step_start += len(c.tokens)
    return XLoraPass(build_step(shadows, block_size), groups) if groups else None


@dataclass
class StepResult:
    """What a backend returns for a step: the candidates of every logits row."""

    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    logits: object | None = None  # [num_logits, vocab] when asked for (numpy natively, lists in the page)
    scores: list[float] | None = None  # per logits row, the log-probability of StepBatch.score_ids' token
