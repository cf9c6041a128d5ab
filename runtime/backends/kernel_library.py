"""RuvLLM's own CPU kernels (runtime/backends/kernels/, onnxruntime custom operators), compiled for
this CPU on first use.

`ruvllm.MatMulQ4` computes what MatMulNBits (4-bit, int8 compute) does, but unpacks the weights once
per block for several rows where MLAS's kernel unpacks them for every row, so batches of decode
streams and prefill chunks stop being bound by the unpacking; its variants MatMulQ4SwiGLU and
MatMulQ4Split also do what follows a projection; `ruvllm.MatMulQ8` is its 8-bit twin for grids with
zero points of 128 (a GGUF's Q8_0 LM head), one pass over the bytes. `ruvllm.PagedAttention` reads each row's KV blocks
in place instead of the graph gathering every context into a copy, and `ruvllm.SkipRMSNorm` replaces
onnxruntime's residual add + RMS norm, ~10x slower per row. graph_rewrite/ rewrites a graph onto
them. All need a C++ compiler and AVX-512 VNNI, or AVX2 with FMA and F16C (`isa()` says which build: the
AVX2 build's attention gives the AVX-512 build's numbers bit for bit; its matmuls the same integer sums),
where onnxruntime's own AVX2 int8 kernel quantizes activations ~2.5x less exactly than rounding each block
to nearest (see docs/PERFORMANCE.md). The library is built once per source, compiler and CPU into the cache
(RUVLLM_CACHE_DIR or ~/.cache/ruvllm, under kernels/), as torch's cpp_extension does; where the CPU
or compiler is missing the native backend runs the package's graph as it is. RUVLLM_CPU_KERNELS=0
turns them all off, RUVLLM_PAGED_ATTENTION=0 the attention only; RUVLLM_KERNEL_ISA=avx2 builds the AVX2
set on an AVX-512 host (so one host can test both builds).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from runtime.aliases import cache_dir

KERNELS = Path(__file__).with_name("kernels")
SOURCE = KERNELS / "register.cpp"  # one translation unit over the op families' headers
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")  # the AVX-512 build
AVX2_FLAGS = ("avx2", "fma", "f16c")  # the AVX2 build
# -ffp-contract=off: no multiply and add fused where the source does not fuse them, so a number is computed
# alike on every path that writes it alike (batch invariance: tests/runtime/test_batch_invariance.py)
COMPILE_FLAGS = ["-O3", "-march=native", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC", "-fvisibility=hidden"]

# The kernels reach onnxruntime's C API by positions in its function table (no registry package ships
# its header), so they run only on the onnxruntime minor versions they were tested with; pyproject pins
# the same range. Another version runs the package's graph as exported, and says why.
TESTED_ONNXRUNTIME = ((1, 32), (1, 32))  # lowest and highest (major, minor), inclusive

_library: tuple[Path | None, str] | None = None  # (path, why not) once decided in this process
_operators: dict[Path, frozenset[str]] = {}
_kv_writers: dict = {}  # kv_writer()'s functions once looked up, per pool dtype (None: none here)


def onnxruntime_supported(version: str) -> tuple[bool, str]:
    """Whether RuvLLM's kernels may load into this onnxruntime, and if not, why."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False, f"cannot read the onnxruntime version {version!r}"
    (lo, hi) = TESTED_ONNXRUNTIME
    if not lo <= (major, minor) <= hi:
        tested = ".".join(map(str, lo)) + ("" if lo == hi else " to " + ".".join(map(str, hi)))
        return False, (f"onnxruntime {version} is not a version these kernels were tested with ({tested}.x; "
                       f"pip install 'onnxruntime=={tested}.*')")
    return True, ""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def library() -> tuple[Path | None, str]:
    """The compiled custom-op library, or None and why it is not used here."""
    global _library
    if _library is None:
        _library = _build()
    return _library


def _build() -> tuple[Path | None, str]:
    if os.environ.get("RUVLLM_CPU_KERNELS", "1") == "0":
        return None, "turned off by RUVLLM_CPU_KERNELS=0"
    import onnxruntime

    ok, why = onnxruntime_supported(onnxruntime.__version__)
    if not ok:
        return None, why
    flags = _cpu_flags()
    compile_flags = list(COMPILE_FLAGS)
    isa = os.environ.get("RUVLLM_KERNEL_ISA", "native")
    if isa == "avx2":
        compile_flags.append("-mno-avx512f")  # drops every AVX-512 subset: the AVX2 build
    elif isa != "native":
        return None, f"RUVLLM_KERNEL_ISA={isa!r} is not 'native' or 'avx2'"
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing and any(f not in flags for f in AVX2_FLAGS):
        return None, f"this CPU lacks {', '.join(missing)} and {', '.join(f for f in AVX2_FLAGS if f not in flags)}"
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        return None, "no C++ compiler (g++) on PATH"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"{compiler} does not run: {err}"
    sources = b"".join(f.read_bytes() for f in sorted(KERNELS.iterdir()) if f.suffix in (".cpp", ".h"))
    key = hashlib.sha256(b"\0".join([sources, version.encode(), " ".join(compile_flags).encode(),
                                     " ".join(sorted(flags)).encode()])).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"libruvllm_cpu_{key}.so"
    if out.exists():
        return out, ""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *compile_flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            return None, f"compiling {SOURCE.name} failed: {proc.stderr.strip()[-500:]}"
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same file
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"compiling {SOURCE.name} failed: {err}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out, ""


def kv_writer(kv_dtype: str = "int8"):
    """ruvllm_kv_write_int8 or ruvllm_kv_write_int4 (kernels/kv_write.h: a step's rows into a quantized KV
    pool and its tails, one pass) as a ctypes function, or None where the library is not built (kv_pool.py
    then writes with numpy)."""
    if kv_dtype not in _kv_writers:
        import ctypes

        lib = library()[0]
        fn = None
        if lib is not None:
            fn = getattr(ctypes.CDLL(str(lib)), f"ruvllm_kv_write_{kv_dtype}")
            fn.restype = ctypes.c_int
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            fn.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64]
        _kv_writers[kv_dtype] = fn
    return _kv_writers[kv_dtype]


def isa(lib: Path | None = None) -> str:
    """Which instruction set the compiled library was built for ("AVX-512 VNNI" or "AVX2"; "" if none)."""
    lib = lib or library()[0]
    if lib is None:
        return ""
    import ctypes

    fn = ctypes.CDLL(str(lib)).ruvllm_kernel_isa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def operators(lib: Path | None = None) -> frozenset[str]:
    """The operators the compiled library registers (both builds: all of them)."""
    lib = lib or library()[0]
    if lib is None:
        return frozenset()
    if lib not in _operators:
        import ctypes

        fn = ctypes.CDLL(str(lib)).ruvllm_kernel_ops
        fn.restype = ctypes.c_char_p
        _operators[lib] = frozenset(fn().decode().split(","))
    return _operators[lib]

