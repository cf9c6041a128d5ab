"""A structured-output constraint (runtime.core.constraints.Constraint) compiled into a byte network
(runtime.core.byte_automaton.Net) for the page, where llguidance has no build.

Covers OpenAI's strict JSON-schema subset and a little more: objects (properties in the schema's
order, `required`, free-form objects), strings (`enum`, `const`, `pattern`, `minLength`/`maxLength`),
integers and numbers (with `minimum`/`maximum`), booleans, null, arrays (`items`,
`minItems`/`maxItems`), `anyOf`/`oneOf`, type lists, `$defs`/`$ref` (recursion included); JSON laid out
as json.dumps writes it (runtime.core.constraints.JSON_LAYOUT), as natively. Also a regex, a choice
of strings and (runtime/core/lark_subset.py) simple Lark grammars. A keyword it cannot enforce is a RequestError naming it, never silently dropped.
"""

from __future__ import annotations

import json

from runtime.core.byte_automaton import Net
from runtime.core.constraints import JSON_LAYOUT, Constraint
from runtime.errors import RequestError

ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
               "readOnly", "writeOnly", "strict", "name"}
ITEM_SEP = JSON_LAYOUT["item_separator"].encode()
KEY_SEP = JSON_LAYOUT["key_separator"].encode()
MAX_UNROLL = 256  # maxItems / maxLength / integer-range values an automaton spells out
DIGITS = set(b"0123456789")
HEX = set(b"0123456789abcdefABCDEF")
PLAIN = set(range(0x20, 0x7F)) - {ord('"'), ord("\\")}  # ASCII a JSON string holds unescaped


def dumps(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(ITEM_SEP.decode(), KEY_SEP.decode())).encode()


def compile_constraint(c: Constraint) -> tuple[Net, tuple[int, int]]:
    """The network and its root fragment; RequestError for what the page cannot enforce."""
    net = Net()
    if c.kind == "json_schema":
        root = SchemaCompiler(net, c.value).compile(c.value, "")
    elif c.kind == "json_object":
        root = SchemaCompiler(net, {}).object_any()
    elif c.kind == "choice":
        root = net.alt(*(net.bytes_(v.encode()) for v in dict.fromkeys(c.value)))
    elif c.kind == "regex":
        root = RegexCompiler(net, c.value, in_json=False).compile()
    else:
        from runtime.core.lark_subset import LarkCompiler

        root = LarkCompiler(net, c.value).compile()
    return net, root


def _utf8_chars(net: Net, a: int, b: int) -> None:
    """Every well-formed multi-byte UTF-8 character from `a` to `b` (no overlongs, no surrogates)."""
    cont = range(0x80, 0xC0)
    need1, need2, need3 = net.state(), net.state(), net.state()
    net.byte_edge(need1, cont, b)
    net.byte_edge(need2, cont, need1)
    net.byte_edge(need3, cont, need2)
    net.byte_edge(a, range(0xC2, 0xE0), need1)
    net.byte_edge(a, [*range(0xE1, 0xED), 0xEE, 0xEF], need2)
    net.byte_edge(a, range(0xF1, 0xF4), need3)
    for lead, second, then in ((0xE0, range(0xA0, 0xC0), need1), (0xED, range(0x80, 0xA0), need1),
                               (0xF0, range(0x90, 0xC0), need2), (0xF4, range(0x80, 0x90), need2)):
        s = net.state()
        net.byte_edge(a, [lead], s)
        net.byte_edge(s, second, then)


def _escape(net: Net, a: int, b: int) -> None:
    """A JSON escape from `a` (after the backslash) to `b`."""
    net.byte_edge(a, b'"\\/bfnrt', b)
    s = net.state()
    net.byte_edge(a, b"u", s)
    for _ in range(3):
        t = net.state()
        net.byte_edge(s, HEX, t)
        s = t
    net.byte_edge(s, HEX, b)


class SchemaCompiler:
    def __init__(self, net: Net, root_schema) -> None:
        self.net = net
        self.root = root_schema
        self.defs: dict[str, tuple[int, int]] = {}
        self._any: tuple[int, int] | None = None

    def fail(self, where: str, what: str) -> RequestError:
        return RequestError(f"the page's JSON-schema matcher cannot enforce {what} (at {where or 'the root'}); "
                            "natively every schema llguidance takes works", "response_format")

    # ---- values ----
    def compile(self, schema, where: str) -> tuple[int, int]:
        net = self.net
        if schema is True or schema == {}:
            return net.call(self.any_value())
        if not isinstance(schema, dict):
            raise self.fail(where, f"the schema {json.dumps(schema)[:40]}")
        known = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                 "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern",
                 "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                 "multipleOf"}
        for key in schema:
            if key not in known and key not in ANNOTATIONS and not (key == "x-guidance" and schema[key] == JSON_LAYOUT):
                raise self.fail(where, f"the keyword {key!r}")
        if "$ref" in schema:
            return net.call(self.ref(schema["$ref"], where))
        if "const" in schema:
            return net.bytes_(dumps(schema["const"]))
        if "enum" in schema:
            if not schema["enum"]:
                raise self.fail(where, "an empty enum")
            return net.alt(*(net.bytes_(v) for v in dict.fromkeys(dumps(v) for v in schema["enum"])))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                return net.alt(*(self.compile({**rest, **sub} if isinstance(sub, dict) else sub, f"{where}/{key}/{i}")
                                 for i, sub in enumerate(schema[key])))
        if "allOf" in schema:
            if len(schema["allOf"]) != 1:
                raise self.fail(where, "allOf with more than one schema")
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            return self.compile({**rest, **schema["allOf"][0]}, f"{where}/allOf/0")
        kind = schema.get("type")
        if isinstance(kind, list):
            return net.alt(*(self.compile({**schema, "type": k}, where) for k in kind))
        if kind is None:
            kind = ("object" if "properties" in schema or "additionalProperties" in schema else
                    "array" if "items" in schema else "string" if "pattern" in schema else None)
            if kind is None:
                return net.call(self.any_value())
        if kind == "object":
            return self.object(schema, where)
        if kind == "array":
            return self.array(schema, where)
        if kind == "string":
            return self.string(schema, where)
        if kind in ("integer", "number"):
            return self.number(schema, where, kind == "integer")
        if kind == "boolean":
            return net.alt(net.bytes_(b"true"), net.bytes_(b"false"))
        if kind == "null":
            return net.bytes_(b"null")
        raise self.fail(where, f"the type {kind!r}")

    def ref(self, ref: str, where: str) -> tuple[int, int]:
        if ref in self.defs:
            return self.defs[ref]
        if ref == "#":
            target = self.root
        elif ref.startswith(("#/$defs/", "#/definitions/")):
            _, section, name = ref.split("/", 2)
            target = (self.root.get(section) or {}).get(name) if isinstance(self.root, dict) else None
            if target is None:
                raise RequestError(f"$ref {ref!r} names no definition in the schema", "response_format")
        else:
            raise self.fail(where, f"the $ref {ref!r} (only #, #/$defs/... and #/definitions/...)")
        # a placeholder first, so a definition that refers to itself calls itself
        start, end = self.net.state(), self.net.state()
        self.defs[ref] = self.net.callable_((start, end))
        body = self.compile(target, ref)
        self.net.seq((start, start), body, (end, end))
        return self.defs[ref]

    def any_value(self) -> tuple[int, int]:
        """Any JSON value (a callable fragment: values nest)."""
        if self._any is None:
            net = self.net
            start, end = net.state(), net.state()
            self._any = net.callable_((start, end))
            body = net.alt(self.object_any(), self.array_items(None, 0, None), self.free_string(),
                           self.number({}, "", False), net.bytes_(b"true"), net.bytes_(b"false"), net.bytes_(b"null"))
            net.seq((start, start), body, (end, end))
        return self._any

    def object_any(self, values=None) -> tuple[int, int]:
        """{"key": value, ...} with any keys (values of schema `values`, or any)."""
        net = self.net
        value = (lambda: net.call(self.any_value())) if values is None else (lambda: self.compile(values, "additionalProperties"))
        pair = lambda: net.seq(self.free_string(), net.bytes_(KEY_SEP), value())  # noqa: E731
        more = net.star(net.seq(net.bytes_(ITEM_SEP), pair()))
        return net.seq(net.bytes_(b"{"), net.opt(net.seq(pair(), more)), net.bytes_(b"}"))

    def object(self, schema: dict, where: str) -> tuple[int, int]:
        net = self.net
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties", True)
        if not props:
            if extra is False:
                return net.bytes_(b"{}")
            return self.object_any(None if extra is True else extra)
        required = set(schema.get("required") or [])
        unknown = required - set(props)
        if unknown:
            raise RequestError(f"required property {sorted(unknown)[0]!r} is not in properties (at "
                               f"{where or 'the root'})", "response_format")
        # properties in the schema's order; an optional one may be left out. first[i]: nothing written yet,
        # before property i; later[i]: something written, before property i
        n = len(props)
        first = [net.state() for _ in range(n + 1)]
        later = [net.state() for _ in range(n + 1)]
        for i, (name, sub) in enumerate(props.items()):
            for src, lead in ((first, b""), (later, ITEM_SEP)):
                frag = net.seq(net.bytes_(lead + dumps(name) + KEY_SEP), self.compile(sub, f"{where}/properties/{name}"))
                net.eps[src[i]].append(frag[0])
                net.eps[frag[1]].append(later[i + 1])
                if name not in required:
                    net.eps[src[i]].append(src[i + 1])
        close = net.bytes_(b"}")
        net.eps[first[n]].append(close[0])
        net.eps[later[n]].append(close[0])
        opening = net.bytes_(b"{")
        net.eps[opening[1]].append(first[0])
        return opening[0], close[1]

    def array(self, schema: dict, where: str) -> tuple[int, int]:
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)) or (hi is not None and hi < lo):
            raise RequestError(f"minItems/maxItems are not a valid range (at {where or 'the root'})", "response_format")
        if max(lo, hi or 0) > MAX_UNROLL:
            raise self.fail(where, f"more than {MAX_UNROLL} minItems/maxItems")
        return self.array_items(schema.get("items"), lo, hi, where)

    def array_items(self, items, lo: int, hi: int | None, where: str = "") -> tuple[int, int]:
        net = self.net
        item = (lambda: net.call(self.any_value())) if items is None or items is True or items == {} else \
            (lambda: self.compile(items, f"{where}/items"))
        if hi == 0:
            return net.bytes_(b"[]")
        parts = [item()] + [net.seq(net.bytes_(ITEM_SEP), item()) for _ in range(1, max(lo, 1))]
        body = net.seq(*parts)  # the first max(lo, 1) items
        if hi is None:
            body = net.seq(body, net.star(net.seq(net.bytes_(ITEM_SEP), item())))
        else:
            tail = net.seq()
            for _ in range(hi - max(lo, 1)):  # nested optional items: [a, b?, c??]
                tail = net.opt(net.seq(net.bytes_(ITEM_SEP), item(), tail))
            body = net.seq(body, tail)
        if lo == 0:
            body = net.opt(body)
        return net.seq(net.bytes_(b"["), body, net.bytes_(b"]"))

    def free_string(self) -> tuple[int, int]:
        net = self.net
        body = net.state()
        net.string_body.add(body)
        net.byte_edge(body, PLAIN, body)
        _utf8_chars(net, body, body)
        esc = net.state()
        net.byte_edge(body, b"\\", esc)
        _escape(net, esc, body)
        start, end = net.state(), net.state()
        net.byte_edge(start, b'"', body)
        net.byte_edge(body, b'"', end)
        return start, end

    def string(self, schema: dict, where: str) -> tuple[int, int]:
        net = self.net
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if "pattern" in schema:
            if lo or hi is not None:
                raise self.fail(where, "a pattern with minLength/maxLength")
            inner = RegexCompiler(net, schema["pattern"], in_json=True).compile()
            return net.seq(net.bytes_(b'"'), inner, net.bytes_(b'"'))
        if not lo and hi is None:
            return self.free_string()
        if max(lo, hi or 0) > MAX_UNROLL:
            raise self.fail(where, f"more than {MAX_UNROLL} minLength/maxLength")
        parts = [self.char() for _ in range(lo)]
        if hi is None:
            parts.append(net.star(self.char()))
        else:
            tail = net.seq()
            for _ in range(hi - lo):
                tail = net.opt(net.seq(self.char(), tail))
            parts.append(tail)
        return net.seq(net.bytes_(b'"'), *parts, net.bytes_(b'"'))

    def char(self) -> tuple[int, int]:
        """One character of a JSON string's text."""
        net = self.net
        a, b = net.state(), net.state()
        net.byte_edge(a, PLAIN, b)
        _utf8_chars(net, a, b)
        esc = net.state()
        net.byte_edge(a, b"\\", esc)
        _escape(net, esc, b)
        return a, b

    def number(self, schema: dict, where: str, integer: bool) -> tuple[int, int]:
        """Integers in [minimum, maximum] digit by digit; numbers as integers in the range, or with a
        fraction where the integer part's whole unit interval lies within the bounds (a subset of the
        valid numbers, never a number outside them); no bounds: any JSON number."""
        net = self.net
        if "multipleOf" in schema:
            raise self.fail(where, "multipleOf")
        inf = float("inf")
        lo, hi = schema.get("minimum", -inf), schema.get("maximum", inf)
        if integer:
            if "exclusiveMinimum" in schema:
                lo = max(lo, schema["exclusiveMinimum"] + 1 if isinstance(schema["exclusiveMinimum"], int)
                         else _ceil(schema["exclusiveMinimum"]))
            if "exclusiveMaximum" in schema:
                hi = min(hi, schema["exclusiveMaximum"] - 1 if isinstance(schema["exclusiveMaximum"], int)
                         else _floor(schema["exclusiveMaximum"]))
        elif "exclusiveMinimum" in schema or "exclusiveMaximum" in schema:
            raise self.fail(where, "exclusiveMinimum/exclusiveMaximum on a number")
        ilo = None if lo == -inf else _ceil(lo)
        ihi = None if hi == inf else _floor(hi)
        if ilo is not None and ihi is not None and ihi < ilo:
            raise RequestError(f"no integer is within the bounds (at {where or 'the root'})", "response_format")
        forms = [self.int_range(ilo, ihi)]
        if not integer:
            frac = net.seq(net.bytes_(b"."), net.byteset(DIGITS), net.star(net.byteset(DIGITS)))
            if lo == -inf and hi == inf:  # any JSON number
                exp = net.seq(net.byteset(b"eE"), net.opt(net.byteset(b"+-")), net.byteset(DIGITS),
                              net.star(net.byteset(DIGITS)))
                return net.seq(forms[0], net.opt(frac), net.opt(exp))
            # k.ddd for k >= 0 with [k, k + 1] inside; -k.ddd with [-k - 1, -k] inside
            up = None if hi == inf else _floor(hi) - 1
            if up is None or up >= max(0, ilo or 0):
                forms.append(net.seq(self._nonneg(max(0, ilo or 0), up), frac))
            neg_hi = None if lo == -inf else _floor(-lo) - 1
            neg_lo = max(0, _ceil(-hi)) if hi != inf else 0
            if neg_hi is None or neg_hi >= neg_lo:
                forms.append(net.seq(net.bytes_(b"-"), self._nonneg(neg_lo, neg_hi), frac))
        return net.alt(*forms)

    def int_range(self, lo: int | None, hi: int | None) -> tuple[int, int]:
        """Decimal integers in [lo, hi] as JSON writes them (None: unbounded)."""
        net = self.net
        forms = []
        if lo is None or lo < 0:  # the negatives, as '-' and a magnitude in [max(1, -hi), -lo]
            forms.append(net.seq(net.bytes_(b"-"), self._nonneg(max(1, -hi) if hi is not None else 1,
                                                                 None if lo is None else -lo)))
        if hi is None or hi >= 0:
            forms.append(self._nonneg(max(lo, 0) if lo is not None else 0, hi))
        return net.alt(*forms)

    def _nonneg(self, lo: int, hi: int | None) -> tuple[int, int]:
        """Non-negative integers in [lo, hi] without leading zeros (hi None: unbounded)."""
        net = self.net
        forms = []
        top = len(str(hi)) if hi is not None else len(str(lo))
        for n in range(len(str(lo)), top + 1):
            a = max(lo, 10 ** (n - 1) if n > 1 else 0)
            b = min(hi, 10 ** n - 1) if hi is not None else 10 ** n - 1
            if a <= b:
                forms.append(self._same_length(str(a), str(b)))
        if hi is None:  # and every longer number
            forms.append(net.seq(net.byteset(set(b"123456789")), *(net.byteset(DIGITS) for _ in range(top)),
                                 net.star(net.byteset(DIGITS))))
        return net.alt(*forms)

    def _same_length(self, a: str, b: str) -> tuple[int, int]:
        """Digit strings of one length from a to b."""
        net = self.net
        if not a:
            return net.seq()
        if a.strip("0") == "" and b.strip("9") == "":
            return net.seq(*(net.byteset(DIGITS) for _ in a))
        if a[0] == b[0]:
            return net.seq(net.bytes_(a[0].encode()), self._same_length(a[1:], b[1:]))
        rest = len(a) - 1
        forms = [net.seq(net.bytes_(a[0].encode()), self._same_length(a[1:], "9" * rest)),
                 net.seq(net.bytes_(b[0].encode()), self._same_length("0" * rest, b[1:]))]
        if int(b[0]) - int(a[0]) > 1:
            middle = {ord(str(d)) for d in range(int(a[0]) + 1, int(b[0]))}
            forms.append(net.seq(net.byteset(middle), *(net.byteset(DIGITS) for _ in range(rest))))
        return net.alt(*forms)


def _ceil(x) -> int:
    return int(-(-x // 1))


def _floor(x) -> int:
    return int(x // 1)


class RegexCompiler:
    """A regular expression (the common subset: literals, ., classes, \\d\\w\\s, groups, |, * + ? {m,n};
    anchored at both ends) into the network. In a JSON string (`in_json`) characters that JSON would
    escape are left out of classes and `.`, and a literal one is refused."""

    def __init__(self, net: Net, pattern: str, in_json: bool) -> None:
        self.net, self.p, self.i, self.in_json = net, pattern, 0, in_json
        printable = set(range(0x20, 0x7F))
        self.any = (printable - {ord('"'), ord("\\")}) if in_json else (printable | {9})

    def error(self, what: str) -> RequestError:
        return RequestError(f"the page's regex matcher cannot take {what} in {self.p!r}", "response_format")

    def compile(self) -> tuple[int, int]:
        if self.p.startswith("^"):
            self.i = 1
        frag = self.alternation()
        if self.i < len(self.p):
            raise self.error(f"{self.p[self.i]!r} at {self.i}")
        return frag

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def alternation(self) -> tuple[int, int]:
        branches = [self.concat()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.concat())
        return branches[0] if len(branches) == 1 else self.net.alt(*branches)

    def concat(self) -> tuple[int, int]:
        parts = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$" and self.i == len(self.p) - 1:
                self.i += 1
                break
            parts.append(self.repeat())
        return self.net.seq(*parts)

    def repeat(self) -> tuple[int, int]:
        start = self.i
        make = self.atom()
        frag = make()
        c = self.peek()
        lo, hi = 1, 1
        if c in ("*", "+", "?"):
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and self._counted():
            lo, hi = self._counted(consume=True)
        else:
            return frag
        if self.peek() == "?":  # lazy: the same language
            self.i += 1
        if max(lo, hi or 0) > MAX_UNROLL:
            raise self.error(f"a count over {MAX_UNROLL} at {start}")
        net = self.net
        parts = [frag] + [make() for _ in range(lo - 1)] if lo else []
        if hi is None:
            parts.append(net.star(make() if lo else frag))
        else:
            tail = net.seq()
            for k in range(hi - lo):
                tail = net.opt(net.seq(frag if not lo and k == 0 else make(), tail))
            parts.append(tail)
        return net.seq(*parts)

    def _counted(self, consume: bool = False):
        j = self.p.find("}", self.i)
        body = self.p[self.i + 1:j] if j > 0 else ""
        lo, _, hi = body.partition(",")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        if consume:
            self.i = j + 1
        return int(lo), (int(lo) if "," not in body else int(hi) if hi else None)

    def atom(self):
        """A function making a fresh copy of the next atom's fragment (counted repeats need copies)."""
        c = self.peek()
        if c == "(":
            self.i += 1
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.error(f"the group syntax at {self.i - 1}")
            begin = self.i
            self.alternation()  # parsed once to find its end; copies re-parse the same text
            if self.peek() != ")":
                raise self.error("an unclosed group")
            end = self.i
            self.i += 1
            return lambda: RegexCompiler(self.net, self.p[begin:end], self.in_json)._whole()
        if c == "[":
            byteset = self._class()
            return lambda: self.net.byteset(byteset)
        if c == ".":
            self.i += 1
            return lambda: self.net.byteset(self.any)
        if c == "\\":
            byteset = self._escape()
            return lambda: self.net.byteset(byteset)
        if c in "*+?{)":
            raise self.error(f"{c!r} at {self.i}")
        self.i += 1
        data = c.encode()
        if self.in_json and (c in '"\\' or ord(c) < 0x20):
            raise self.error(f"the character {c!r} (JSON would escape it)")
        return lambda: self.net.bytes_(data)

    def _whole(self) -> tuple[int, int]:
        frag = self.alternation()
        if self.i != len(self.p):
            raise self.error(f"{self.p[self.i]!r} at {self.i}")
        return frag

    CLASSES = {"d": set(b"0123456789"), "w": set(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"),
               "s": set(b" \t\n\r\f\v")}

    def _escape(self) -> set[int]:
        c = self.p[self.i + 1] if self.i + 1 < len(self.p) else ""
        self.i += 2
        if c.lower() in self.CLASSES:
            got = self.CLASSES[c.lower()]
            got = (self.any - got) if c.isupper() else got
        elif c in "ntrfv":
            got = {ord({"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}[c])}
        elif c and not c.isalnum() and ord(c) < 0x80:
            got = {ord(c)}
        else:
            raise self.error(f"the escape \\{c}")
        return self._allowed(got)

    def _allowed(self, byteset: set[int]) -> set[int]:
        return byteset & self.any if self.in_json else byteset

    def _class(self) -> set[int]:
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        got: set[int] = set()
        first = True
        while self.peek() is not None and (self.peek() != "]" or first):
            first = False
            if self.peek() == "\\":
                lo_set = self._escape()
                if len(lo_set) != 1:
                    got |= lo_set
                    continue
                lo = next(iter(lo_set))
            else:
                lo = ord(self.p[self.i])
                self.i += 1
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                if self.peek() == "\\":
                    hi_set = self._escape()
                    hi = next(iter(hi_set))
                else:
                    hi = ord(self.p[self.i])
                    self.i += 1
                got |= set(range(lo, hi + 1))
            else:
                got.add(lo)
        if self.peek() != "]":
            raise self.error("an unclosed [class]")
        self.i += 1
        if any(x >= 0x80 for x in got):
            raise self.error("a non-ASCII character class")
        return self._allowed(self.any - got if negate else got)
