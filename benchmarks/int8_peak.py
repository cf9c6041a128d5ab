"""This machine's int8 multiply-accumulate ceiling: how many VNNI dot products (vpdpbusd, 64 byte products
into 16 int32 lanes; AVX-512 VNNI) its cores issue a second, on 1 and on --threads threads (not a
test).

    python benchmarks/int8_peak.py [--threads 2] [--seconds 1]

Every int8 weight a projection multiplies costs one MAC per row: a 512-token prompt through a model of P
matrix parameters is 512 P MACs, and 16 decode rows 16 P. Against this figure, a prefill's time (or a batch
decode step's) shows how far the kernels are from what the cores can do at all: time >= MACs / peak. The
loop keeps 12 independent accumulators, so only the instruction's issue rate bounds it. Where the CPU has
AMX-INT8 (Sapphire Rapids and later; /proc/cpuinfo's amx_int8) the tile unit's rate is measured too: tdpbssd,
a 16 x 64 by 64 x 16 int8 product (16,384 MACs) into an int32 tile, four independent accumulator tiles, after
asking Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM). Prints JSON.
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

AMX_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
// Linux hands a process the AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
int amx_allow(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }
struct tile_config { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
// n iterations of 4 independent tdpbssd (16 x 16 x 64 MACs each) on tiles 0-3, A in 4-5, B in 6-7
int64_t amx_spin(int64_t n, int32_t seed) {
  struct tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
  static __thread int8_t a[16 * 64], b[16 * 64];
  static __thread int32_t out[16 * 16];
  for (int i = 0; i < 16 * 64; i++) { a[i] = (int8_t)(seed + i); b[i] = (int8_t)(seed * 3 + i); }
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, a, 64); _tile_loadd(5, b, 64); _tile_loadd(6, b, 64); _tile_loadd(7, a, 64);
  for (int64_t k = 0; k < n; k++) {
    _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
"""
AMX_MACS_PER_ITERATION = 4 * 16 * 16 * 64


def build(out: Path) -> ctypes.CDLL:
    src = out / "peak.c"
    src.write_text(SOURCE)
    lib = out / "peak.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-mavx512f", "-mavx512vnni", str(src), "-o", str(lib)],
                   check=True)
    dll = ctypes.CDLL(str(lib))
    dll.spin.restype, dll.spin.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int32]
    return dll


def build_amx(out: Path) -> ctypes.CDLL | None:
    """The tile loop, where the CPU has AMX-INT8 and Linux grants the tile state; else None."""
    if "amx_int8" not in Path("/proc/cpuinfo").read_text():
        return None
    src = out / "amx.c"
    src.write_text(AMX_SOURCE)
    lib = out / "amx.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-mamx-tile", "-mamx-int8", str(src), "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.amx_spin.restype, dll.amx_spin.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int32]
    return dll if dll.amx_allow() == 0 else None


def rate(spin, threads: int, seconds: float, macs: int = MACS_PER_ITERATION) -> float:
    """MACs a second over `threads` threads, each spinning for about `seconds` (ctypes releases the GIL);
    spin(n, seed) runs n iterations of `macs` multiply-adds."""
    n = 1 << 16
    t0 = time.perf_counter()
    spin(n, 1)
    per_iter = (time.perf_counter() - t0) / n
    iters = max(1, int(seconds / per_iter))
    workers = [threading.Thread(target=spin, args=(iters, i + 2)) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return threads * iters * macs / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(Path(tmp))
        out = {"date": time.strftime("%Y-%m-%d")}
        for threads in (1, args.threads):
            best = max(rate(dll.spin, threads, args.seconds) for _ in range(args.repeats))
            out[f"vpdpbusd_gmac_s_{threads}_thread{'s' if threads > 1 else ''}"] = round(best / 1e9, 1)
        amx = build_amx(Path(tmp))
        for threads in (1, args.threads) if amx else ():
            best = max(rate(amx.amx_spin, threads, args.seconds, AMX_MACS_PER_ITERATION) for _ in range(args.repeats))
            out[f"amx_tdpbssd_gmac_s_{threads}_thread{'s' if threads > 1 else ''}"] = round(best / 1e9, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
