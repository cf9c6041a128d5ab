"""The Lark grammars the page can enforce: rules of string literals, /regex/ terminals, rule references,
( ) groups, [ ] options, | ? * +, and llguidance's `%json {schema}` (the shape of the tool-call
grammar runtime/serve/tools.py writes). Compiled into the same byte network as JSON schemas; anything
else (%import, %ignore, priorities, regex flags) is a RequestError naming it.
"""

from __future__ import annotations

import json
import re

from runtime.core.byte_automaton import Net
from runtime.core.schema_automaton import RegexCompiler, SchemaCompiler
from runtime.errors import RequestError

_RULE = re.compile(r"^([?!]?)([A-Za-z_][A-Za-z_0-9]*)\s*:\s*(.*)$", re.S)
_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<re>/(?:[^/\\]|\\.)+/[a-z]*)|(?P<json>%json\b)|'
                    r'(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<op>[()\[\]|?*+]))')


def _error(what: str) -> RequestError:
    return RequestError(f"the page's grammar matcher cannot take {what} (it takes rules of strings, /regex/, "
                        "rule names, ( ) [ ] | ? * + and %json); natively llguidance takes any Lark grammar",
                        "response_format")


class LarkCompiler:
    def __init__(self, net: Net, text: str) -> None:
        self.net = net
        self.rules: dict[str, str] = {}
        for line in _join_lines(text):
            m = _RULE.match(line)
            if not m:
                raise _error(f"the line {line[:40]!r}")
            self.rules[m.group(2)] = m.group(3).strip()
        if "start" not in self.rules:
            raise RequestError("the grammar has no start rule", "response_format")
        self.compiled: dict[str, tuple[int, int]] = {}

    def compile(self) -> tuple[int, int]:
        return self.net.call(self.rule("start"))

    def rule(self, name: str) -> tuple[int, int]:
        if name not in self.compiled:
            if name not in self.rules:
                raise RequestError(f"the grammar uses the rule {name!r} but defines none", "response_format")
            start, end = self.net.state(), self.net.state()
            self.compiled[name] = self.net.callable_((start, end))
            body = _Expansion(self, self.rules[name]).parse()
            self.net.seq((start, start), body, (end, end))
        return self.compiled[name]


def _join_lines(text: str) -> list[str]:
    """Rules one per entry: a line starting with '|' continues the rule above; comments dropped."""
    out: list[str] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        if line.lstrip().startswith("%"):
            raise _error(f"the directive {line.strip().split()[0]!r}")
        if line.lstrip().startswith("|") and out:
            out[-1] += " " + line.strip()
        else:
            out.append(line.strip())
    return out


class _Expansion:
    """One rule's right-hand side, parsed into fragments as it is read."""

    def __init__(self, lark: LarkCompiler, text: str) -> None:
        self.lark, self.net, self.text, self.i = lark, lark.net, text, 0

    def parse(self) -> tuple[int, int]:
        frag = self.alternatives()
        if self.text[self.i:].strip():
            raise _error(f"{self.text[self.i:][:20]!r}")
        return frag

    def peek(self) -> str | None:
        m = _TOKEN.match(self.text, self.i)
        return m.group("op") if m and m.group("op") else None

    def alternatives(self) -> tuple[int, int]:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i = _TOKEN.match(self.text, self.i).end()
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else self.net.alt(*branches)

    def sequence(self) -> tuple[int, int]:
        parts = []
        while self.text[self.i:].strip() and self.peek() not in ("|", ")", "]"):
            begin = self.i
            frag = self.atom()
            op = self.peek()
            if op in ("?", "*", "+"):
                after = _TOKEN.match(self.text, self.i).end()
                if op == "+":  # x x*: the repeat parses x again for states of its own
                    self.i = begin
                    frag = self.net.seq(frag, self.net.star(self.atom()))
                else:
                    frag = self.net.opt(frag) if op == "?" else self.net.star(frag)
                self.i = after
            parts.append(frag)
        return self.net.seq(*parts)

    def atom(self) -> tuple[int, int]:
        m = _TOKEN.match(self.text, self.i)
        if not m:
            raise _error(f"{self.text[self.i:][:20]!r}")
        self.i = m.end()
        if m.group("str"):
            return self.net.bytes_(json.loads(m.group("str")).encode())
        if m.group("re"):
            body, flags = m.group("re")[1:].rsplit("/", 1)
            if flags:
                raise _error(f"the regex flags {flags!r}")
            return RegexCompiler(self.net, body, in_json=False).compile()
        if m.group("json"):
            start = len(self.text) - len(self.text[self.i:].lstrip())
            try:
                schema, end = json.JSONDecoder().raw_decode(self.text, start)
            except json.JSONDecodeError as err:
                raise RequestError(f"%json takes a JSON schema: {err}", "response_format") from None
            self.i = end
            return SchemaCompiler(self.net, schema).compile(schema, "%json")
        if m.group("name"):
            return self.net.call(self.lark.rule(m.group("name")))
        op = m.group("op")
        if op in ("(", "["):
            inner = self.alternatives()
            close = _TOKEN.match(self.text, self.i)
            if not close or close.group("op") != {"(": ")", "[": "]"}[op]:
                raise _error("an unclosed group")
            self.i = close.end()
            return self.net.opt(inner) if op == "[" else inner
        raise _error(f"{op!r} here")
