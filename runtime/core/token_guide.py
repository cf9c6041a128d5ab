"""Structured output in pure Python: the page's guide (llguidance has no Pyodide build), also usable
natively with RUVLLM_GUIDE=python. Same interface as runtime/backends/guidance.py: `guide.matcher(
constraint)` gives a runtime.core.constraints.Matcher.

A constraint compiles into a byte network (runtime/core/schema_automaton.py). A step's mask walks a
trie of the vocabulary's byte strings from the matcher's state, pruning every branch the network
refuses. Three things keep that cheap enough for Pyodide:
- masks are cached per network state, and a JSON document revisits few states (the same key, the same
  kind of value, the same string interior);
- inside a free string, the tokens of plain text (no quote, backslash or control byte, whole UTF-8
  characters) are allowed as a precomputed set and leave the state as it is, so only the few thousand
  other tokens are walked;
- byte transitions are memoized per state set.
"""

from __future__ import annotations

from collections import OrderedDict

from runtime.core.byte_automaton import ACCEPT, Net, StateSet
from runtime.core.constraints import Constraint
from runtime.core.schema_automaton import compile_constraint

_COMPILED = 32  # constraints kept compiled, with their cached masks
_MASKS = 4096  # masks kept per constraint


class TokenTrie:
    """The vocabulary's byte strings as a trie: children[node] maps a byte to a node, ids[node] lists the
    tokens that end there."""

    def __init__(self, tokens: list[tuple[int, bytes]]) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.ids: list[list[int]] = [[]]
        for tid, data in tokens:
            node = 0
            for b in data:
                nxt = self.children[node].get(b)
                if nxt is None:
                    nxt = self.children[node][b] = len(self.children)
                    self.children.append({})
                    self.ids.append([])
                node = nxt
            self.ids[node].append(tid)


def _plain(data: bytes) -> bool:
    """Text a free JSON string holds as it is: whole UTF-8 characters, no quote, backslash or control byte."""
    if any(b < 0x20 or b in (0x22, 0x5C, 0x7F) for b in data):
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class Compiled:
    def __init__(self, c: Constraint) -> None:
        self.net, root = compile_constraint(c)
        self.start = self.net.start(root)
        self.masks: OrderedDict[StateSet, bytes] = OrderedDict()


class PyGuide:
    def __init__(self, token_bytes: list[bytes], vocab_size: int, eos_ids: list[int]) -> None:
        """token_bytes[i]: the bytes token i writes (empty for special tokens)."""
        self.vocab_size = vocab_size
        self.nbytes = (vocab_size + 7) // 8
        self.token_bytes = token_bytes
        self.eos = frozenset(e for e in eos_ids if 0 <= e < vocab_size)
        self.plain = [bool(d) and _plain(d) for d in token_bytes]
        tokens = [(i, d) for i, d in enumerate(token_bytes) if d and i < vocab_size]
        self.trie = TokenTrie(tokens)
        self.rest = TokenTrie([(i, d) for i, d in tokens if not self.plain[i]])
        self.plain_bits = self._bits(i for i, d in tokens if self.plain[i])
        self.eos_bits = self._bits(self.eos)
        self._compiled: OrderedDict[str, Compiled] = OrderedDict()

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, eos_ids: list[int]) -> PyGuide:
        return cls([tokenizer.token_bytes(i) for i in range(vocab_size)], vocab_size, eos_ids)

    def _bits(self, ids) -> int:
        mask = bytearray(self.nbytes)
        for t in ids:
            mask[t >> 3] |= 1 << (t & 7)
        return int.from_bytes(mask, "little")

    def matcher(self, c: Constraint) -> PyMatcher:
        key = c.key()
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = Compiled(c)
            while len(self._compiled) > _COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return PyMatcher(self, compiled)

    def mask(self, compiled: Compiled, states: StateSet) -> bytes:
        got = compiled.masks.get(states)
        if got is not None:
            compiled.masks.move_to_end(states)
            return got
        net = compiled.net
        if net.in_free_string(states):
            bits = self.plain_bits | self._walk(net, self.rest, states)
        else:
            bits = self._walk(net, self.trie, states)
        if ACCEPT in states:
            bits |= self.eos_bits
        got = compiled.masks[states] = bits.to_bytes(self.nbytes, "little")
        while len(compiled.masks) > _MASKS:
            compiled.masks.popitem(last=False)
        return got

    def _walk(self, net: Net, trie: TokenTrie, states: StateSet) -> int:
        """The tokens of `trie` whose bytes the network takes from `states`."""
        mask = bytearray(self.nbytes)
        children, ids, step = trie.children, trie.ids, net.step
        todo = [(0, states)]
        while todo:
            node, s = todo.pop()
            for b, child in children[node].items():
                n = step(s, b)
                if n:
                    for t in ids[child]:
                        mask[t >> 3] |= 1 << (t & 7)
                    if children[child]:
                        todo.append((child, n))
        return int.from_bytes(mask, "little")


class PyMatcher:
    """One request's position in its constraint (runtime.core.constraints.Matcher)."""

    def __init__(self, guide: PyGuide, compiled: Compiled) -> None:
        self.guide = guide
        self.compiled = compiled
        self.states = compiled.start
        self.ended = False

    def allowed_bits(self) -> bytes:
        if self.ended:
            return self.guide.eos_bits.to_bytes(self.guide.nbytes, "little")
        return self.guide.mask(self.compiled, self.states)

    def consume(self, token: int) -> bool:
        g = self.guide
        if token in g.eos:
            self.ended = ACCEPT in self.states
            return self.ended
        data = g.token_bytes[token] if 0 <= token < len(g.token_bytes) else b""
        if not data or self.ended:
            return False
        net = self.compiled.net
        if g.plain[token] and net.in_free_string(self.states):
            return True  # plain text inside a free string: the same state
        s = self.states
        for b in data:
            s = net.step(s, b)
            if not s:
                return False
        self.states = s
        return True

    def is_stopped(self) -> bool:
        return self.ended or self.states == frozenset((ACCEPT,))
