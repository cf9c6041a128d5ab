"""exporter.heap: freed memory inside glibc's heap goes back to the system."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CODE = """
from exporter.heap import release_freed
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) / 1024
blocks = [bytearray(b"x" * 65536) for _ in range(3000)]  # 190 MB under the mmap threshold: in the heap
kept = blocks[::50]  # a survivor every 3 MB: the heap's top cannot shrink past them
del blocks
before = rss()
release_freed()
print(before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_chunks_inside_the_heap_are_returned():
    returned = float(subprocess.run([sys.executable, "-c", CODE], check=True, capture_output=True, text=True,
                                    cwd=Path(__file__).resolve().parents[2]).stdout)
    assert returned > 100, returned
