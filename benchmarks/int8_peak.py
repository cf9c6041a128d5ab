"""This machine's int8 multiply-accumulate ceiling: how many VNNI dot products (vpdpbusd, 64 byte products
into 16 int32 lanes; AVX-512 VNNI) its cores issue a second, on 1 and on --threads threads (not a
test).

    python benchmarks/int8_peak.py [--threads 2] [--seconds 1]

Every int8 weight a projection multiplies costs one MAC per row: a 512-token prompt through a model of P
matrix parameters is 512 P MACs, and 16 decode rows 16 P. Against this figure, a prefill's time (or a batch
decode step's) shows how far the kernels are from what the cores can do at all: time >= MACs / peak. The
loop keeps 12 independent accumulators, so only the instruction's issue rate bounds it. Prints JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
// n iterations of 12 independent vpdpbusd (64 MACs each); returns a value so nothing is optimized out.
// The accumulators are twelve named variables, not an array: gcc -O2 kept an array on the stack, and the
// stores and loads around each vpdpbusd then bounded the loop at about half the instruction's rate.
#define EACH(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
int64_t spin(int64_t n, int32_t seed) {
  __m512i a = _mm512_set1_epi32(seed), b = _mm512_set1_epi32(seed * 3 + 1);
#define INIT(i) __m512i c##i = _mm512_set1_epi32(i);
  EACH(INIT)
  for (int64_t k = 0; k < n; k++) {
#define DOT(i) c##i = _mm512_dpbusd_epi32(c##i, a, b);
    EACH(DOT)
    __asm__ volatile("" : "+v"(a));  // a may have changed: the loop is not folded
  }
#define SUM(i) c0 = _mm512_add_epi32(c0, c##i);
  EACH(SUM)
  return _mm512_reduce_add_epi32(c0);
}
"""
MACS_PER_ITERATION = 12 * 64


def build(out: Path) -> ctypes.CDLL:
    src = out / "peak.c"
    src.write_text(SOURCE)
    lib = out / "peak.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-mavx512f", "-mavx512vnni", str(src), "-o", str(lib)],
                   check=True)
    dll = ctypes.CDLL(str(lib))
    dll.spin.restype, dll.spin.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int32]
    return dll


def rate(dll: ctypes.CDLL, threads: int, seconds: float) -> float:
    """MACs a second over `threads` threads, each spinning for about `seconds` (ctypes releases the GIL)."""
    n = 1 << 20
    t0 = time.perf_counter()
    dll.spin(n, 1)
    per_iter = (time.perf_counter() - t0) / n
    iters = max(1, int(seconds / per_iter))
    workers = [threading.Thread(target=dll.spin, args=(iters, i + 2)) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return threads * iters * MACS_PER_ITERATION / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(Path(tmp))
        one = max(rate(dll, 1, args.seconds) for _ in range(args.repeats))
        many = max(rate(dll, args.threads, args.seconds) for _ in range(args.repeats))
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "vpdpbusd_gmac_s_1_thread": round(one / 1e9, 1),
                      f"vpdpbusd_gmac_s_{args.threads}_threads": round(many / 1e9, 1)}, indent=1))


if __name__ == "__main__":
    main()
