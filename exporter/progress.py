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
    """tqdm's small interface as two lines on stderr: the stage starting and its end with the time taken."""

    def __init__(self, iterable: Iterable | None, total: int | None, desc: str) -> None:
        self.iterable, self.total, self.desc, self.n = iterable, total, desc, 0
        self.started = time.monotonic()
        print(f"export: {desc}" + (f" ({total} steps)" if total else "") + " ...", file=sys.stderr, flush=True)

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.n += 1
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        if self.started is not None:
            print(f"export: {self.desc} done in {time.monotonic() - self.started:.1f} s", file=sys.stderr, flush=True)
            self.started = None


class _Off(_Lines):
    def __init__(self, iterable, total, desc) -> None:
        self.iterable, self.started = iterable, None

    def __iter__(self):
        yield from self.iterable

    def update(self, n: int = 1) -> None:
        pass


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
    return (_Lines if chosen == "lines" else _Off)(iterable, total, desc)
