"""RuvLLM's own CPU kernel for 4-bit weights (q4_kernel.cpp), compiled for this CPU on first use.

A batch of decode streams is compute-bound in MatMulNBits, whose int8 kernel unpacks the weights again
for every row; q4_kernel.cpp's `ruvllm.MatMulQ4` unpacks them once per block for several rows and
computes the same int8 arithmetic. It needs AVX-512 VNNI and a C++ compiler: the library is built
once per source, compiler and CPU into the cache (RUVLLM_CACHE_DIR or ~/.cache/ruvllm, under kernels/),
as torch's cpp_extension does, and where either is missing the native backend runs the package's graph
as it is. RUVLLM_Q4_KERNEL=0 turns it off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from runtime.aliases import cache_dir

SOURCE = Path(__file__).with_name("q4_kernel.cpp")
DOMAIN, OP = "ruvllm", "MatMulQ4"
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
COMPILE_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden"]

_library: tuple[Path | None, str] | None = None  # (path, why not) once decided in this process


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
    if os.environ.get("RUVLLM_Q4_KERNEL", "1") == "0":
        return None, "turned off by RUVLLM_Q4_KERNEL=0"
    flags = _cpu_flags()
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}"
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        return None, "no C++ compiler (g++) on PATH"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"{compiler} does not run: {err}"
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), version.encode(), " ".join(COMPILE_FLAGS).encode(),
                                     " ".join(sorted(flags)).encode()])).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"libruvllm_q4_{key}.so"
    if out.exists():
        return out, ""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *COMPILE_FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
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


def rewrite_graph(graph: Path) -> tuple[bytes, int]:
    """The graph with every MatMulNBits the kernel computes the same way replaced by ruvllm.MatMulQ4
    (weights stay where they are: the model's external data is read from the package's folder).

    Only 4-bit nodes with int8 compute (accuracy_level 4), packed uint8 zero points and fp32 scales,
    all initializers, qualify; the rest (fp32-compute test packages, fp16 scales) keep MLAS's kernel.
    """
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    count = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.input) != 4:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        block, n = attrs.get("block_size", 0), attrs.get("N", 0)
        if attrs.get("bits", 4) != 4 or attrs.get("accuracy_level", 0) != 4 or not block or block % 32 or n % 16:
            continue
        b, s, z = (inits.get(name) for name in node.input[1:])
        if (b is None or s is None or z is None or b.data_type != onnx.TensorProto.UINT8
                or s.data_type != onnx.TensorProto.FLOAT or z.data_type != onnx.TensorProto.UINT8):
            continue
        node.op_type, node.domain = OP, DOMAIN
        count += 1
    if count:
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return model.SerializeToString(), count
