"""Pre-tokenizer regexes of `tokenizers`, translated for the standard `re` module.

Pyodide has no `regex` module, so `\\p{L}`, `\\p{N}` and `\\s` are expanded into explicit classes
built from `unicodedata`. `\\s` means Unicode White_Space (as in Oniguruma), not Python's
`str.isspace`, which also matches U+001C..U+001F.
"""

from __future__ import annotations

import re
import unicodedata
from functools import cache, lru_cache
from operator import itemgetter

# GPT-2's pattern: what ByteLevel(use_regex=True) splits with.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


# Letters and numbers end with plane 3 (CJK extensions); planes 4-13 are unassigned and 14-16 hold
# only tags, variation selectors and private use. Scanning 0x40000 code points, not 0x110000, makes
# the tables ~4x cheaper to build (it matters in Pyodide); tests check them against a full scan.
SCAN_END = 0x40000


@cache
def _category_tables(end: int = SCAN_END) -> dict[str, str]:
    """Character-class bodies (no brackets) for the major categories L and N, from one scan.

    The scan is a string of every code point's major category, built and searched by C loops
    (map, join, re): a Python loop over 0x40000 code points took ~0.2 s natively, more in Pyodide.
    """
    majors = "".join(map(itemgetter(0), map(unicodedata.category, map(chr, range(end)))))
    return {m: "".join(_range(run.start(), run.end() - 1) for run in re.finditer(f"{m}+", majors))
            for m in ("L", "N")}


def _category_ranges(prefix: str, end: int = SCAN_END) -> str:
    """A character-class body for every code point whose category starts with prefix (L or N)."""
    return _category_tables(end)[prefix]


def _range(a: int, b: int) -> str:
    lo, hi = f"\\U{a:08x}", f"\\U{b:08x}"
    return lo if a == b else f"{lo}-{hi}"


_CLASSES = {"L": lambda: _category_ranges("L"), "N": lambda: _category_ranges("N")}


def translate(pattern: str) -> str:
    """Rewrite a tokenizers (Oniguruma) pattern into an equivalent `re` pattern."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt in "pP" and pattern[i + 2:i + 3] == "{":
                end = pattern.index("}", i)
                name = pattern[i + 3:end]
                if name not in _CLASSES:
                    raise ValueError(f"unsupported unicode class \\p{{{name}}}")
                body = _CLASSES[name]()
                if nxt == "P":
                    if in_class:
                        raise ValueError("\\P{..} inside a class is not supported")
                    out.append(f"[^{body}]")
                else:
                    out.append(body if in_class else f"[{body}]")
                i = end + 1
                continue
            if nxt == "s":
                out.append(WHITE_SPACE if in_class else f"[{WHITE_SPACE}]")
                i += 2
                continue
            if nxt == "S":
                if in_class:
                    raise ValueError("\\S inside a class is not supported")
                out.append(f"[^{WHITE_SPACE}]")
                i += 2
                continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class and out and out[-1] not in ("[", "[^"):
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


@lru_cache(maxsize=32)
def compile_pattern(pattern: str) -> re.Pattern:
    return re.compile(translate(pattern))


def split_isolated(pattern: re.Pattern, text: str) -> list[str]:
    """Split keeping both the matches and the text between them (`Isolated` behaviour)."""
    pieces, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos:m.start()])
        if m.end() > m.start():
            pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def split_digits(text: str, individual: bool) -> list[str]:
    """`Digits` pre-tokenizer: isolate runs of (or single) Unicode decimal digits."""
    pieces: list[str] = []
    buf = ""
    for ch in text:
        is_digit = unicodedata.category(ch) == "Nd"
        if is_digit and individual:
            if buf:
                pieces.append(buf)
            pieces.append(ch)
            buf = ""
        elif buf and (buf[-1:] and (unicodedata.category(buf[-1]) == "Nd") != is_digit):
            pieces.append(buf)
            buf = ch
        else:
            buf += ch
    if buf:
        pieces.append(buf)
    return pieces
