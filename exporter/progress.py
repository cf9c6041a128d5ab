"""Export progress: a tqdm bar per stage on a terminal, one plain line per stage elsewhere (a log, a pipe).

`RUVLLM_PROGRESS=bars|lines|off` overrides the choice; `ruvllm` sets it for the exporter it runs, whose
stderr is a pipe even when the user watches a terminal.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable


def mode(enabled: bool = True) -> str:
    if not enabled:
        return "off"
    forced = os.environ.get("RUVLLM_PROGRESS")
    if forced in ("bars", "lines", "off"):
        return forced
    return "bars" if sys.stderr.isatty() else "lines"


class _Lines:
    """tqdm's small interface as two lines on stderr (the stage starting, then its end with the time
    taken), or as nothing when say is False."""

    def __init__(self, iterable: Iterable | None, total: int | None, desc: str, say: bool) -> None:
        self.iterable, self.desc = iterable, desc
        self.started = time.monotonic() if say else None
        if say:
            print(f"export: {desc}" + (f" ({total} steps)" if total else "") + " ...", file=sys.stderr, flush=True)

    def __iter__(self):
        yield from self.iterable
        self.close()

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        if self.started is not None:
            print(f"export: {self.desc} done in {time.monotonic() - self.started:.1f} s", file=sys.stderr, flush=True)
            self.started = None


def stage(desc: str, iterable: Iterable | None = None, total: int | None = None, enabled: bool = True):
    """A stage of the export: iterate over it, or call update() and close()."""
    chosen = mode(enabled)
    if chosen == "bars":
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, leave=True, file=sys.stderr,
                    bar_format="{desc:<22} {bar} {n_fmt}/{total_fmt} [{elapsed}]" if (total or iterable is not None)
                    else "{desc:<22} [{elapsed}]")
    if iterable is not None and total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    return _Lines(iterable, total, desc, say=chosen == "lines")
