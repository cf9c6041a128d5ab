"""Stop strings that may span token boundaries, with text held back until it cannot start one."""

from __future__ import annotations


class StopChecker:
    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include_stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit, stopped)."""
        if not self.stops:
            return delta, False
        self.pending += delta
        first = None
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            i, s = first
            out = self.pending[: i + len(s)] if self.include else self.pending[:i]
            self.pending = ""
            return out, True
        keep = 0
        for k in range(min(self.hold, len(self.pending)), 0, -1):  # longest suffix that starts a stop
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
