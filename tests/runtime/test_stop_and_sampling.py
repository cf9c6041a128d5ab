"""Stop strings across token boundaries and the candidate sampler."""

from __future__ import annotations

import math
import random

from runtime.core.sampling import SamplingParams, choose
from runtime.core.stop import StopChecker


def run(stopper: StopChecker, deltas: list[str]) -> tuple[str, bool]:
    out = []
    for d in deltas:
        text, hit = stopper.feed(d)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + stopper.flush(), False


def test_stop_string_spanning_deltas():
    assert run(StopChecker(["END"]), ["abc E", "N", "D more"]) == ("abc ", True)
    assert run(StopChecker(["END"], include_stop=True), ["abc E", "ND"]) == ("abc END", True)


def test_partial_match_is_held_back_then_released():
    s = StopChecker(["###"])
    assert s.feed("a#") == ("a", False)
    assert s.feed("#") == ("", False)
    assert s.feed("b") == ("##b", False)


def test_earliest_of_several_stops_wins():
    assert run(StopChecker(["world", "lo w"]), ["hello world"]) == ("hel", True)


def test_greedy_picks_the_first_candidate():
    assert choose([7, 3, 9], [-0.1, -2.0, -3.0], SamplingParams(temperature=0.0), random.Random(0)) == 7


def test_top_k_one_is_greedy_and_min_p_cuts_the_tail():
    p = SamplingParams(temperature=1.0, top_k=1)
    assert all(choose([4, 5], [math.log(0.5), math.log(0.5)], p, random.Random(i)) == 4 for i in range(20))
    p = SamplingParams(temperature=1.0, min_p=0.5)
    lps = [math.log(0.6), math.log(0.35), math.log(0.05)]
    assert {choose([1, 2, 3], lps, p, random.Random(i)) for i in range(200)} == {1, 2}


def test_top_p_keeps_the_nucleus_and_frequencies_follow_probabilities():
    p = SamplingParams(temperature=1.0, top_p=0.7)
    lps = [math.log(0.5), math.log(0.3), math.log(0.2)]
    draws = [choose([1, 2, 3], lps, p, random.Random(i)) for i in range(2000)]
    assert 3 not in draws
    share = draws.count(1) / len(draws)
    assert abs(share - 0.5 / 0.8) < 0.05


def test_validation_names_the_field():
    import pytest

    from runtime.errors import RequestError

    for kwargs, field in (({"max_tokens": -1}, "max_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0}, "top_p"), ({"logprobs": 50}, "logprobs")):
        with pytest.raises(RequestError, match=field):
            SamplingParams(**kwargs).validate()
