"""DRY (runtime/core/dry.py) against its definition, and on a model's greedy loop."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.core.dry import MAX_MATCH, match_penalties, penalize


def reference(tokens, multiplier, base, allowed, last_n, breakers):
    """Straight from the definition: for each earlier j whose token is the last one, the longest run of
    equal tokens ending at j and at the end (within the window, no breaker in it), then its follower."""
    n = len(tokens)
    start = 0 if last_n < 0 else max(0, n - last_n)
    if multiplier <= 0 or last_n == 0 or n - start < 2 or tokens[-1] in breakers:
        return {}
    best = {}
    for j in range(start, n - 1):
        length = 0
        while (length < MAX_MATCH and j - length >= start and tokens[j - length] == tokens[n - 1 - length]
               and tokens[j - length] not in breakers):
            length += 1
        if length >= allowed and length >= 1:
            best[tokens[j + 1]] = max(best.get(tokens[j + 1], 0), length)
    return {t: multiplier * base ** (length - allowed) for t, length in best.items()}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=60), st.integers(1, 4), st.integers(-1, 70),
       st.sets(st.integers(0, 4), max_size=2))
def test_penalties_follow_the_definition(tokens, allowed, last_n, breakers):
    got = match_penalties(tokens, 0.8, 1.75, allowed, last_n, breakers.__contains__)
    assert got == pytest.approx(reference(tokens, 0.8, 1.75, allowed, last_n, breakers))


def test_a_repeat_is_penalized_by_its_length():
    # "a b c d ... a b c" -> d would extend a 3-token repeat: 0.8 * 1.75 ** (3 - 2)
    assert match_penalties([1, 2, 3, 4, 9, 1, 2, 3], 0.8, 1.75, 2, -1, lambda t: False) == {4: 0.8 * 1.75}
    assert match_penalties([1, 2, 3, 4, 9, 1, 2, 3], 0.8, 1.75, 4, -1, lambda t: False) == {}  # allowed
    assert match_penalties([1, 2, 3, 4, 9, 1, 2, 3], 0.8, 1.75, 2, -1, lambda t: t == 2) == {}  # broken
    assert match_penalties([1, 2, 3, 4, 9, 1, 2, 3], 0.0, 1.75, 2, -1, lambda t: False) == {}  # off


def test_penalize_moves_mass_and_resorts():
    ids, lps = [7, 8, 9], [math.log(0.6), math.log(0.3), math.log(0.1)]
    out_ids, out_lps = penalize(ids, lps, {7: 100.0}, 1.0)
    assert out_ids == [8, 9, 7]
    probs = [math.exp(x) for x in out_lps]
    assert probs[0] == pytest.approx(0.75) and probs[1] == pytest.approx(0.25) and probs[2] < 1e-40
    assert penalize(ids, lps, {5: 3.0}, 1.0) == (ids, lps)  # a token outside the candidates changes nothing


def repeated_trigrams(tokens: list[int], start: int) -> int:
    """Generated positions whose 3-gram (ending there) appeared earlier in the sequence."""
    seen, hits = set(), 0
    for t in range(2, len(tokens)):
        gram = tuple(tokens[t - 2:t + 1])
        if t >= start and gram in seen:
            hits += 1
        seen.add(gram)
    return hits


@pytest.mark.slow
def test_strong_dry_breaks_a_greedy_loop(tiny_package):
    """Greedy decoding of a tiny random model repeats itself; with DRY at full strength (every repeat of
    two tokens costs 100) no generated 3-gram repeats an earlier one, over the CLI's and the server's
    parsing alike."""
    from runtime.core.engine import Engine
    from runtime.core.sampling import SamplingParams
    from runtime.serve import openai_protocol as P

    engine = Engine.from_package(tiny_package("llama"), speculative_tokens=0)
    prompt = engine.tokenizer.encode("one two three one two three one two")

    def run(params):
        return [t for o in engine.generate(prompt, params) for t in o.token_ids]

    plain = run(SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    assert repeated_trigrams(prompt + plain, len(prompt)) > 10  # the loop DRY is for
    body = {"model": "m", "prompt": "x", "temperature": 0, "max_tokens": 80, "ignore_eos": True,
            "dry_multiplier": 100.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_sequence_breakers": ["\u0001"]}
    params = P.parse_completion(body).params
    dry = run(params)
    assert len(dry) == 80 and repeated_trigrams(prompt + dry, len(prompt)) == 0


def test_dry_fields_are_checked():
    from runtime.serve import openai_protocol as P

    for field, value in (("dry_multiplier", -1), ("dry_base", 1.0), ("dry_allowed_length", 0),
                         ("dry_penalty_last_n", -2), ("dry_sequence_breakers", [""]), ("dry_allowed_length", 2.5)):
        with pytest.raises(P.ProtocolError) as err:
            P.parse_completion({"model": "m", "prompt": "x", field: value})
        assert err.value.param == field
