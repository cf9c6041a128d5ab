"""What one feedback teaches, as trainer steps: shared by the native trainer (runtime/serve/personalization.py
over micro_lora.py) and the page's (runtime/serve/web_personal.py over the WASM step's learn.h), so that a
feedback is the same steps in both homes. Standard library only (it runs in Pyodide)."""

from __future__ import annotations

from typing import NamedTuple


class LearnStep(NamedTuple):
    """One optimizer step: the loss of `ids` from `scored_from` on (the unlikelihood loss when
    `unlikely`), at lr x lr_scale."""

    ids: list[int]
    scored_from: int = 0
    unlikely: bool = False
    lr_scale: float = 1.0


def text_chunks(ids: list[int], chunk: int):
    """The text's pieces of `chunk` predictions each (chunk + 1 tokens, the last shared with the next piece)."""
    for s in range(0, len(ids) - 1, chunk):
        yield ids[s:s + chunk + 1]


def feedback_steps(kind: str, ids: list[int], scored_from: int, rating: float, chunk: int, epochs: int,
                   window: int) -> list[LearnStep]:
    """A text: every chunk, each epoch. An answer (preferred, or rated): the answer whole after as much of
    its conversation as fits the model's `window` positions, at the rating's fraction of the step size
    (below zero the unlikelihood loss). A rating of zero teaches nothing."""
    if kind == "rating" and rating == 0:
        return []
    if kind == "text":
        return [LearnStep(part) for _ in range(epochs) for part in text_chunks(ids, chunk)]
    if len(ids) > window:  # keep the reply whole, and as much of its conversation as fits
        cut = len(ids) - window
        ids, scored_from = ids[cut:], max(scored_from - cut, 1)
    return [LearnStep(ids, scored_from, rating < 0, abs(rating)) for _ in range(epochs)]


def refresh_before(done: int, planned: int, every: int) -> list[int]:
    """The steps of a feedback (indices into its plan) before which EWC++'s Fisher is measured again: every
    `every`-th step a user's trainer takes, counting its steps over all feedbacks (`done` before this
    one), the first included, so that a new user's Fisher is measured before anything moves. Counted in
    steps, not feedbacks: a long text is many steps, and its factors drift as far as its steps take them."""
    if every <= 0:
        return []
    return [j for j in range(planned) if (done + j) % every == 0]
