"""After the graph: choose each token, check stops, detokenize, and say what the client sees.

The graph has already applied penalties, bias and temperature and returned top-K candidates per
logits row (runtime/core/sampling.py says why that is exact); what is left per token is cheap and
per request, so it lives here, apart from the scheduler's KV bookkeeping.
"""

from __future__ import annotations

from runtime.core.config import ModelConfig
from runtime.core.dry import BreakerTable, match_penalties, penalize
from runtime.core.sampling import choose, make_rng
from runtime.core.sequence import RequestOutput, Sequence, TokenLogprob
from runtime.core.stats import EngineStats
from runtime.core.step_batch import PenaltyState
from runtime.core.stop import StopChecker
from runtime.text.tokenizer import IncrementalDecoder, Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, model: ModelConfig, stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.stats = stats
        self._breakers: dict[tuple[str, ...], BreakerTable] = {}  # DRY's, by breaker set

    def admit(self, seq: Sequence) -> None:
        """Give a new request its sampler, detokenizer, stop checker and penalty state."""
        p = seq.params
        seq.decoder = IncrementalDecoder(self.tokenizer)
        seq.stopper = StopChecker(p.stop, p.include_stop_str_in_output)
        seq.rng = make_rng(p.seed)
        if p.dry:
            key = tuple(p.dry_sequence_breakers)
            if key not in self._breakers:
                if len(self._breakers) >= 16:  # each request may name its own set: keep a few
                    self._breakers.clear()
                self._breakers[key] = BreakerTable(self.tokenizer.decode_token, key)
            seq.dry_breakers = self._breakers[key]
        if p.penalized:
            seq.penalties = PenaltyState()
            seq.penalties.add_prompt(seq.prompt_ids)
            seq.penalties.add_bias(p.logit_bias)

    def process(self, seq: Sequence, rows: list[tuple[list[int], list[float]]], draft: list[int]) -> list[RequestOutput]:
        """Choose a token per logits row, in order, while each choice equals the draft the next row
        assumed (row j follows j drafted tokens); stop at a mismatch or when the request finishes."""
        outputs = []
        for j, (ids, lps) in enumerate(rows):
            out = self._accept(seq, ids, lps)
            outputs.append(out)
            if out.finished or j == len(draft) or out.token_ids[0] != draft[j]:
                break
        return outputs

    def score_prompt(self, seq: Sequence, chunk, scored: list) -> None:
        """prompt_logprobs: the chunk's scored rows, each the prompt's next token's log-probability (the backend's
        StepResult.scores) and the likeliest alternatives there (the row's candidates, unprocessed)."""
        top = seq.params.prompt_logprobs
        for j, ((ids, lps), logprob) in enumerate(scored):
            at = chunk.start + j  # the row at position `at` scores prompt token at + 1, kept at index `at`
            while len(seq.prompt_scores) <= at:
                seq.prompt_scores.append(None)
            seq.prompt_scores[at] = TokenLogprob(chunk.score_ids[j], logprob, list(zip(ids, lps))[:top])

    def prompt_only(self, seq: Sequence) -> RequestOutput:
        """max_tokens 0: the request ends once its prompt is computed."""
        return RequestOutput(seq.id, "", [], True, "length", len(seq.prompt_ids), 0, cached_tokens=seq.cached_tokens)

    def _accept(self, seq: Sequence, ids: list[int], lps: list[float]) -> RequestOutput:
        p = seq.params
        if p.dry:
            penalties = match_penalties(seq.tokens, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                                        p.dry_penalty_last_n, seq.dry_breakers)
            token = choose(*penalize(ids, lps, penalties, p.logits_temperature), p, seq.rng)
        else:
            token = choose(ids, lps, p, seq.rng)
        if seq.thinking is not None:  # past its thinking budget the reply's next token closes the block
            token = seq.thinking.next(token)
        seq.tokens.append(token)
        self.stats.generated_tokens += 1
        if seq.penalties is not None:
            seq.penalties.add_generated(token)
        logprobs = []
        if p.logprobs is not None:
            lp = dict(zip(ids, lps)).get(token, float("-inf"))
            logprobs.append(TokenLogprob(token, lp, list(zip(ids, lps))[: p.logprobs]))
        reason, by_string = None, False
        complete = False
        if seq.matcher is not None:
            if not seq.matcher.consume(token):  # the grammar's own mask allowed a token it then refuses
                return RequestOutput(seq.id, "", [], True, "error", len(seq.prompt_ids), seq.num_generated - 1,
                                     error=f"structured output: this model's tokens cannot continue the constraint "
                                           f"(its mask allowed token {token}, which it then refused)",
                                     error_param="response_format")
            complete = seq.matcher.is_stopped()
        if (token in self.model.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason, text = "stop", ""
        else:  # a stop string, or a grammar that is satisfied and allows nothing more, ends the text here
            text, by_string = seq.stopper.feed(seq.decoder.add(token))
            reason = "stop" if by_string or complete else None
        if reason is None and (seq.num_generated >= p.max_tokens or len(seq.tokens) >= self.model.max_context):
            reason = "length"
        if reason is not None and not by_string:  # release text held back for a stop string that never came
            tail, hit = seq.stopper.feed(seq.decoder.flush())
            text += tail if hit else tail + seq.stopper.flush()
        return RequestOutput(seq.id, text, [token], reason is not None, reason, len(seq.prompt_ids),
                             seq.num_generated, logprobs, cached_tokens=seq.cached_tokens)
