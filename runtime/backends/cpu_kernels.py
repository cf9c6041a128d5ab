"""RuvLLM's own CPU kernels (cpu_kernels.cpp, onnxruntime custom operators), compiled for this CPU on
first use, and the rewrite of a package's graph onto them.

`ruvllm.MatMulQ4` computes what MatMulNBits (4-bit, int8 compute) does, but unpacks the weights once
per block for several rows where MLAS's kernel unpacks them for every row, so batches of decode
streams and prefill chunks stop being bound by the unpacking. `ruvllm.PagedAttention` replaces each
layer's attention path, which gathers every row's context out of the KV pool into a copy each step,
with one operator that reads the blocks in place. Two variants of MatMulQ4 also do what follows a
projection in the exported graph (fuse_epilogues): MatMulQ4SwiGLU the MLP's silu(gate) * up,
MatMulQ4Split the q/k/v split. `ruvllm.SkipRMSNorm` replaces onnxruntime's residual add + RMS norm,
whose kernel is ~10x slower per row (fuse_norms). All need AVX-512 VNNI and a C++ compiler; on a CPU
with AVX2, FMA and F16C only, the library holds the 4-bit matmuls alone (`operators()` says which), in
AVX2, where onnxruntime's own AVX2 int8 kernel quantizes activations ~2.5x less exactly than rounding
each block to nearest (see docs/PERFORMANCE.md). The library is built once per source, compiler and CPU
into the cache (RUVLLM_CACHE_DIR or ~/.cache/ruvllm, under kernels/), as torch's cpp_extension does;
where the CPU or compiler is missing the native backend runs the package's graph as it is. RUVLLM_CPU_KERNELS=0 turns them all off,
RUVLLM_PAGED_ATTENTION=0 the attention only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from runtime.aliases import cache_dir

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
DOMAIN, OP = "ruvllm", "MatMulQ4"
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")  # the full set of operators
AVX2_FLAGS = ("avx2", "fma", "f16c")  # the 4-bit matmuls alone
COMPILE_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden"]

# The kernels reach onnxruntime's C API by positions in its function table (no registry package ships
# its header), so they run only on the onnxruntime minor versions they were tested with; pyproject pins
# the same range. Another version runs the package's graph as exported, and says why.
TESTED_ONNXRUNTIME = ((1, 32), (1, 32))  # lowest and highest (major, minor), inclusive

_library: tuple[Path | None, str] | None = None  # (path, why not) once decided in this process
_operators: dict[Path, frozenset[str]] = {}


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
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), version.encode(), " ".join(COMPILE_FLAGS).encode(),
                                     " ".join(sorted(flags)).encode()])).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"libruvllm_cpu_{key}.so"
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


def operators(lib: Path | None = None) -> frozenset[str]:
    """The operators the compiled library registers: all of them with AVX-512, the 4-bit matmuls with AVX2."""
    lib = lib or library()[0]
    if lib is None:
        return frozenset()
    if lib not in _operators:
        import ctypes

        fn = ctypes.CDLL(str(lib)).ruvllm_kernel_ops
        fn.restype = ctypes.c_char_p
        _operators[lib] = frozenset(fn().decode().split(","))
    return _operators[lib]


def rewrite_graph(graph: Path, config: dict | None = None, ops: frozenset[str] | None = None) -> tuple[bytes, int, int]:
    """The graph with every MatMulNBits the kernel computes the same way replaced by ruvllm.MatMulQ4
    (weights stay where they are: the model's external data is read from the package's folder), and,
    given the package's config, each layer's attention by ruvllm.PagedAttention (fuse_attention).
    Returns the graph and how many projections and layers were replaced.

    `ops`: the operators to use (default: all); an AVX2 build has MatMulQ4 alone (`operators`).
    Only 4-bit nodes with int8 compute (accuracy_level 4), packed uint8 zero points and fp32 scales,
    all initializers, qualify; the rest (fp32-compute test packages, fp16 scales) keep MLAS's kernel.
    A GGUF package's block minimums are folded into the kernel where fp16 holds them (fuse_minimums).
    """
    import onnx

    ops = frozenset(("MatMulQ4", "PagedAttention", "SkipRMSNorm")) if ops is None else ops
    model = onnx.load(str(graph), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    count = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or len(node.input) != 4:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        block, n = attrs.get("block_size", 0), attrs.get("N", 0)
        if ("MatMulQ4" not in ops or attrs.get("bits", 4) != 4 or attrs.get("accuracy_level", 0) != 4 or not block
                or block % 32 or n % 16):
            continue
        b, s, z = (inits.get(name) for name in node.input[1:])
        if (b is None or s is None or z is None or b.data_type != onnx.TensorProto.UINT8
                or s.data_type != onnx.TensorProto.FLOAT or z.data_type != onnx.TensorProto.UINT8):
            continue
        node.op_type, node.domain = OP, DOMAIN
        node.attribute.append(onnx.helper.make_attribute("mins", 0))
        count += 1
    if count:
        fuse_minimums(model)
        fuse_epilogues(model)
    layers = 0
    head_dim = (config or {}).get("head_dim", 0)
    if ("PagedAttention" in ops and config is not None and head_dim % 16 == 0 and (head_dim <= 128 or head_dim == 256)
            and os.environ.get("RUVLLM_PAGED_ATTENTION", "1") != "0"):
        layers = fuse_attention(model, config["num_layers"], config["num_heads"], config["num_kv_heads"],
                                config.get("sliding_window"))
    norms = fuse_norms(model) if "SkipRMSNorm" in ops else 0
    if count or layers or norms:
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return model.SerializeToString(), count, layers


def _consumers(nodes) -> dict[str, list]:
    """Each tensor name -> the nodes reading it."""
    consumers: dict[str, list] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def fuse_minimums(model) -> int:
    """Fold each block-minimum term the exporter adds beside a 4-bit projection (exporter/block_matmul.py:
    Gemm(MatMul(x, block_ones), Cast(fp16 minimums), C=MatMulNBits(x))) into its ruvllm.MatMulQ4,
    which then reads the minimums as a fifth input. Terms with fp32 minimums (not exact in fp16) stay
    as they are, beside the kernel. Returns how many were folded."""
    import onnx

    nodes = list(model.graph.node)
    inits = {i.name: i for i in model.graph.initializer}
    consumers = _consumers(nodes)
    producer = {name: node for node in nodes for name in node.output}
    graph_outputs = {o.name for o in model.graph.output}
    removed, count = set(), 0
    for node in nodes:
        if node.op_type != OP or node.domain != DOMAIN:
            continue
        users = consumers.get(node.output[0], [])
        gemm = users[0] if len(users) == 1 and users[0].op_type == "Gemm" and len(users[0].input) == 3 else None
        plain = gemm and not any(a.name in ("transA", "transB") and a.i or a.name in ("alpha", "beta") and a.f != 1
                                 for a in gemm.attribute)
        sums = plain and gemm.input[2] == node.output[0] and producer.get(gemm.input[0])
        cast = plain and producer.get(gemm.input[1])
        mins = cast and cast.op_type == "Cast" and inits.get(cast.input[0])
        if not (sums and sums.op_type == "MatMul" and sums.input[0] == node.input[0] and mins
                and mins.data_type == onnx.TensorProto.FLOAT16 and node.output[0] not in graph_outputs):
            continue
        node.input.append(mins.name)
        next(a for a in node.attribute if a.name == "mins").i = 1
        node.output[0] = gemm.output[0]
        removed.update((id(gemm), id(sums)))
        if consumers.get(cast.output[0]) == [gemm]:
            removed.add(id(cast))
        count += 1
    if removed:
        _drop(model, nodes, removed)
    return count


def fuse_norms(model) -> int:
    """Each SkipSimplifiedLayerNormalization without bias whose mean and inverse deviation no one reads
    becomes ruvllm.SkipRMSNorm (outputs: the normed rows and the residual sum), ~10x faster than
    onnxruntime's at 576 wide. Returns how many."""
    import onnx

    consumers = _consumers(model.graph.node)
    graph_outputs = {o.name for o in model.graph.output}
    count = 0
    for i, node in enumerate(model.graph.node):
        if node.op_type != "SkipSimplifiedLayerNormalization" or node.domain != "com.microsoft" or len(node.input) != 3:
            continue
        outs = list(node.output) + [""] * (4 - len(node.output))
        if any(name and (name in consumers or name in graph_outputs) for name in outs[1:3]):
            continue
        eps = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon"), 1e-5)
        fused = onnx.helper.make_node("SkipRMSNorm", list(node.input), [outs[0], outs[3] or f"{outs[0]}.sum"],
                                      name=node.name, domain=DOMAIN, epsilon=float(eps))
        model.graph.node[i].CopyFrom(fused)
        count += 1
    return count


def fuse_epilogues(model) -> tuple[int, int]:
    """Fold what follows a projection into the kernel's output: the MLP's gate/up projection followed by
    Split, Sigmoid and two Muls becomes one ruvllm.MatMulQ4SwiGLU writing silu(gate) * up; the attention's
    q/k/v projection followed by Unsqueeze and Split becomes one ruvllm.MatMulQ4Split writing the q+k and
    v parts as two tensors. Each removed operator was a pass over the projection's output (and a
    dispatch, which is most of their cost at one decode row). Returns how many of each were folded."""
    import onnx
    from onnx import numpy_helper

    nodes = list(model.graph.node)
    inits = {i.name: i for i in model.graph.initializer}
    consumers = _consumers(nodes)
    graph_outputs = {o.name for o in model.graph.output}

    def only(name: str, op_type: str):
        users = consumers.get(name, [])
        ok = len(users) == 1 and users[0].op_type == op_type and users[0].domain in ("", "ai.onnx")
        return users[0] if ok and name not in graph_outputs else None

    def attr(node, name: str, default=None):
        return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)

    def const(node, i: int) -> list[int] | None:
        init = inits.get(node.input[i]) if len(node.input) > i else None
        return [int(v) for v in numpy_helper.to_array(init).reshape(-1)] if init is not None else None

    removed, swiglu, qkv = set(), 0, 0
    for node in nodes:
        if node.op_type != OP or node.domain != DOMAIN:
            continue
        n = next(a.i for a in node.attribute if a.name == "N")
        split = only(node.output[0], "Split")
        if split and attr(split, "axis") in (1, -1) and const(split, 1) == [n // 2, n // 2] and n % 32 == 0:
            gate, up = split.output
            users = consumers.get(gate, [])
            sig = next((u for u in users if u.op_type == "Sigmoid"), None)
            silu = sig and only(sig.output[0], "Mul")
            prod = silu and only(silu.output[0], "Mul")
            if (len(users) == 2 and silu in users and set(silu.input) == {gate, sig.output[0]} and prod
                    and set(prod.input) == {silu.output[0], up} and consumers.get(up) == [prod]):
                node.op_type = "MatMulQ4SwiGLU"
                node.output[0] = prod.output[0]
                removed.update(id(x) for x in (split, sig, silu, prod))
                swiglu += 1
            continue
        unsqueeze = only(node.output[0], "Unsqueeze")  # [tokens, 1, n], split along n into q+k and v
        split = unsqueeze and const(unsqueeze, 1) == [1] and only(unsqueeze.output[0], "Split")
        parts = split and len(split.output) == 2 and attr(split, "axis") in (2, -1) and const(split, 1)
        v_users = consumers.get(split.output[1], []) if parts else []
        if (parts and sum(parts) == n and parts[0] % 16 == 0 and parts[1] > 0 and v_users
                and all(u.op_type == "Reshape" for u in v_users) and split.output[1] not in graph_outputs):
            node.op_type = "MatMulQ4Split"
            node.attribute.append(onnx.helper.make_attribute("split", parts[0]))
            node.output.append(split.output[1])  # v: [tokens, n_v] where it was [tokens, 1, n_v]: only reshaped
            unsqueeze.output[0] = split.output[0]  # q+k: the Unsqueeze now gives RotaryEmbedding its 3-D input
            removed.add(id(split))
            qkv += 1
    if removed:
        _drop(model, nodes, removed)
    return swiglu, qkv


def _drop(model, nodes: list, removed: set[int]) -> None:
    """The graph without the nodes whose id() is in `removed`, and without the value infos and
    initializers (e.g. the minimums' block-sum matrices) that only those nodes used."""
    keep = [node for node in nodes if id(node) not in removed]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    live = {name for node in keep for name in (*node.input, *node.output)}
    kept_info = [v for v in model.graph.value_info if v.name in live]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept_info)
    for t in [t for t in model.graph.initializer if t.name not in live]:
        model.graph.initializer.remove(t)


def fuse_attention(model, num_layers: int, num_heads: int, num_kv_heads: int, sliding_window: int | None) -> int:
    """Replace each layer's attention path (pool gather, in-place write of this step's K/V, scores, mask,
    softmax, weighted values) with one ruvllm.PagedAttention that reads the pool's blocks in place; the
    nodes only that path used are dropped. Returns how many layers were fused: all or none (a graph that
    does not have the exported shape, e.g. a ScatterND one, is left as it is)."""
    from onnx import helper

    from runtime import contract as C

    nodes = list(model.graph.node)
    consumers = _consumers(nodes)
    producer = {name: node for node in nodes for name in node.output}

    def only(name: str, op_type: str):
        found = [n for n in consumers.get(name, []) if n.op_type == op_type]
        return found[0] if len(found) == 1 else None

    fused = []
    for layer in range(num_layers):
        paths = []
        for pool in (C.past_key(layer), C.past_value(layer)):
            gather = only(pool, "Gather")
            reshape = gather and only(gather.output[0], "Reshape")
            scatter = reshape and only(reshape.output[0], "TensorScatter")
            update = scatter and producer.get(scatter.input[1])
            if not (update and update.op_type == "Gather"):
                return 0
            paths.append((scatter, update.input[0]))
        (k_ctx, qk), (v_ctx, v) = paths
        scores = only(k_ctx.output[0], "FusedMatMul")
        weighted = only(v_ctx.output[0], "MatMul")
        gather_nd = weighted and only(weighted.output[0], "GatherND")
        out = gather_nd and only(gather_nd.output[0], "Reshape")
        if not (scores and out):
            return 0
        scale = next((a.f for a in scores.attribute if a.name == "alpha"), 1.0)
        fused.append((out, helper.make_node(
            "PagedAttention", [qk, v, C.past_key(layer), C.past_value(layer), C.BLOCK_TABLES, C.QUERY_INDEX,
                               C.POSITION_IDS], [out.output[0]], domain=DOMAIN, name=f"paged_attention_{layer}",
            num_heads=num_heads, num_kv_heads=num_kv_heads, sliding_window=int(sliding_window or 0), scale=scale)))
    replaced = {id(out): new for out, new in fused}
    nodes = [replaced.get(id(n), n) for n in nodes]
    # drop what only the old attention paths computed (the masks, the index tensors, the gathers)
    live = {o.name for o in model.graph.output}
    keep = []
    for node in reversed(nodes):
        if any(name in live for name in node.output):
            keep.append(node)
            live.update(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
    return len(fused)
