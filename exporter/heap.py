"""Freed memory handed back to the system between an export's large steps.

glibc keeps what numpy and torch free below its mmap threshold (which rises up to 32 MB as large blocks
are freed) in its heap, and returns only the heap's top: in a 7B GPTQ export layer by layer, ~0.9 GB of
freed chunks stayed resident between layers (docs/PERFORMANCE.md, session 41).
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), "malloc_trim", None)
    except OSError:  # not glibc (musl has no malloc_trim to speak of)
        return None


def release_freed() -> None:
    """glibc's malloc_trim(0): the heap's free pages given back, wherever they lie; nothing elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
