"""A byte-level recursive transition network: what the page's structured output compiles a constraint
into (runtime/core/schema_automaton.py) and walks token by token (runtime/core/token_guide.py).

Why a network with calls and not a plain automaton: JSON nests, and a schema's `$ref` can recurse, so
a constraint is a set of small automata that call each other. A position is a thread (state, return
stack); the matcher's state is the frozenset of live threads after the bytes so far, so alternatives
(`anyOf`, a string that may end or go on) are followed together and a state can be a cache key.
Pure standard library: it runs in Pyodide.
"""

from __future__ import annotations

ACCEPT = (-1, ())  # the thread that stands for "the text may end here"
MAX_DEPTH = 64  # calls deep: a schema that recurses without consuming a byte stops here
StateSet = frozenset  # of threads: (state, return stack) pairs


class Net:
    """States with byte edges, epsilon edges and call edges (enter a callee's start, come back to a
    state when it reaches one of its `returns`). Fragments are (start, end) pairs of states."""

    def __init__(self) -> None:
        self.edges: list[dict[int, list[int]]] = []
        self.eps: list[list[int]] = []
        self.calls: list[list[tuple[int, int]]] = []
        self.returns: set[int] = set()
        self.string_body: set[int] = set()  # inside a free JSON string: plain text loops back here
        self._step: dict[tuple[StateSet, int], StateSet] = {}

    def state(self) -> int:
        self.edges.append({})
        self.eps.append([])
        self.calls.append([])
        return len(self.edges) - 1

    # ---- building ----
    def byte_edge(self, a: int, byteset, b: int) -> None:
        for x in byteset:
            self.edges[a].setdefault(x, []).append(b)

    def bytes_(self, data: bytes) -> tuple[int, int]:
        start = s = self.state()
        for x in data:
            t = self.state()
            self.edges[s].setdefault(x, []).append(t)
            s = t
        return start, s

    def byteset(self, byteset) -> tuple[int, int]:
        a, b = self.state(), self.state()
        self.byte_edge(a, byteset, b)
        return a, b

    def seq(self, *frags: tuple[int, int]) -> tuple[int, int]:
        if not frags:
            s = self.state()
            return s, s
        for (_, end), (start, _) in zip(frags, frags[1:]):
            self.eps[end].append(start)
        return frags[0][0], frags[-1][1]

    def alt(self, *frags: tuple[int, int]) -> tuple[int, int]:
        a, b = self.state(), self.state()
        for start, end in frags:
            self.eps[a].append(start)
            self.eps[end].append(b)
        return a, b

    def opt(self, frag: tuple[int, int]) -> tuple[int, int]:
        a, b = self.alt(frag)
        self.eps[a].append(b)
        return a, b

    def star(self, frag: tuple[int, int]) -> tuple[int, int]:
        a, b = self.state(), self.state()
        self.eps[a] += [frag[0], b]
        self.eps[frag[1]] += [frag[0], b]
        return a, b

    def call(self, callee: tuple[int, int]) -> tuple[int, int]:
        """A fragment that runs the callable fragment `callee` (made with `callable_`) and comes back."""
        a, b = self.state(), self.state()
        self.calls[a].append((callee[0], b))
        return a, b

    def callable_(self, frag: tuple[int, int]) -> tuple[int, int]:
        self.returns.add(frag[1])
        return frag

    # ---- running ----
    def closure(self, threads) -> StateSet:
        """The threads reachable without a byte, kept where a byte can move them (or ACCEPT)."""
        out, seen, todo = set(), set(), list(threads)
        while todo:
            t = todo.pop()
            if t in seen:
                continue
            seen.add(t)
            s, stack = t
            if self.edges[s]:
                out.add(t)
            todo.extend((e, stack) for e in self.eps[s])
            if len(stack) < MAX_DEPTH:
                todo.extend((start, stack + (ret,)) for start, ret in self.calls[s])
            if s in self.returns:
                if stack:
                    todo.append((stack[-1], stack[:-1]))
                else:
                    out.add(ACCEPT)
        return frozenset(out)

    def start(self, root: tuple[int, int]) -> StateSet:
        self.returns.add(root[1])
        return self.closure([(root[0], ())])

    def step(self, states: StateSet, byte: int) -> StateSet:
        key = (states, byte)
        got = self._step.get(key)
        if got is None:
            nxt = []
            for s, stack in states:
                if s >= 0:
                    nxt.extend((t, stack) for t in self.edges[s].get(byte, ()))
            got = self._step[key] = self.closure(nxt) if nxt else frozenset()
        return got

    def in_free_string(self, states: StateSet) -> bool:
        """Every thread inside a free JSON string's text, where plain text keeps the state as it is."""
        return bool(states) and all(s in self.string_body for s, _ in states)
