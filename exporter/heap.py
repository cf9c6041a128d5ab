"""Freed memory handed back to the system between an export's large steps.

glibc keeps what numpy and torch free below its mmap threshold (which rises up to 32 MB as large blocks
are freed) in its heap, and returns only the heap's top: in a 7B GPTQ export layer by layer, ~0.9 GB of
freed chunks stayed resident between layers (docs/PERFORMANCE.md, session 41).
"""

from __future__ import annotations

import ctypes
import functools
import sys

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
MAPPED_FROM = 4 << 20  # bytes: blocks this large and larger are mapped, and unmapped when freed


@functools.cache
def _libc(name: str):
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name, None)
    except OSError:  # not glibc (musl has no malloc_trim to speak of)
        return None


def map_large_blocks() -> None:
    """Large blocks mapped on their own from now on, at a fixed threshold (mallopt), so a 7B layer's
    per-sequence activations (8-30 MB each) are unmapped when freed; glibc's own threshold rises as large
    blocks are freed and leaves them in the heap until a trim (release_freed, after each calibration
    sequence and each GPTQ group: without those the heap grew ~24 MB a sequence, 0.4 GB a pass at 7B)."""
    mallopt = _libc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)


def release_freed() -> None:
    """glibc's malloc_trim(0): the heap's free pages given back, wherever they lie; nothing elsewhere."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)
