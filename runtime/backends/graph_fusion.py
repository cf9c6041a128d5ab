"""Rewrites a package's graph onto RuvLLM's CPU kernels (kernel_library.py), and counts what can be
rewritten, so that the exporter can declare it in the manifest and the runtime can refuse to run a
declared fusion silently slower.

Each fuser matches the shape the exporter builds (exporter/builders/, exporter/quantizers/block_matmul.py)
and replaces it with one of the `ruvllm` operators; a graph of another shape is left as it is, and
the count says so.
"""

from __future__ import annotations

import math
from pathlib import Path

DOMAIN, OP = "ruvllm", "MatMulQ4"
ALL_OPS = frozenset(("MatMulQ4", "MatMulQ8", "PagedAttention", "SkipRMSNorm", "LoraDelta", "SampleTopK"))


def fusable_head_dim(head_dim: int) -> bool:
    """Head sizes ruvllm.PagedAttention is compiled for."""
    return head_dim % 16 == 0 and (head_dim <= 128 or head_dim == 256)


def fuse(model, config: dict | None = None, ops: frozenset[str] = ALL_OPS, base_dir: Path | None = None,
         half_adapters: bool = False, kv_dtype: str = "fp32", kv_tails: bool = True,
         weights: dict | None = None) -> dict[str, int]:
    """Rewrite `model` in place with the operators in `ops`: every MatMulNBits the kernel computes the
    same way becomes ruvllm.MatMulQ4 (with its epilogues and block minimums folded in), and, given the
    package's config, each layer's attention ruvllm.PagedAttention (fuse_attention) and each residual
    add + RMS norm ruvllm.SkipRMSNorm, and the sampling tail ruvllm.SampleTopK (fuse_sampling). Returns how
    many of each were replaced.

    Only 4-bit nodes with int8 compute (accuracy_level 4), packed uint8 zero points and fp32 scales,
    all initializers, qualify; the rest (fp32-compute test packages, fp16 scales) keep MLAS's kernel.
    A GGUF package's block minimums are folded into the kernel where fp16 holds them (fuse_minimums).
    8-bit nodes of that kind whose zero points are all 128 (a GGUF's Q8_0: the integers minus 128 fit a
    signed byte whatever they are) become ruvllm.MatMulQ8; `base_dir` is where the graph's external
    data lives, to read those zero points. `half_adapters`: the LoRA graph's adapter inputs that only
    RuvLLM's LoRA operators read become fp16 (adapters_in_half). `kv_dtype` "int8" or "int4": the KV pool
    inputs that only ruvllm.PagedAttention reads become int8 (int4: packed in uint8) with their group scales
    (kv_quantized, with fp16 tails unless `kv_tails` is False); an int8 pool elsewhere is read by
    the graph's own attention (kv_in_int8_graph). `weights`: where the weights made for a host without the
    kernels go, in memory rather than in the graph (block_layouts.portable_graph).
    """
    import onnx

    from runtime.backends.block_layouts import kernel_grid, portable_graph

    if "MatMulQ4" not in ops:  # layouts only the kernel reads (a GGUF's Q4_K) become MatMulNBits
        portable_graph(model, base_dir, weights)
    inits = {i.name: i for i in model.graph.initializer}
    # the exporter's own MatMulQ4 (a GGUF's Q4_K at its own bits): already on the kernel, counted as fused
    count = sum(1 for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP)
    q8 = sum(1 for n in model.graph.node if n.domain == DOMAIN and n.op_type == "MatMulQ8")
    for node in model.graph.node:
        layout = kernel_grid(node, inits)
        op = None if layout is None else {4: "MatMulQ4", 8: "MatMulQ8"}.get(layout.bits)
        if op not in ops:
            continue
        if op == "MatMulQ8":
            if _all_128(inits[node.input[3]], base_dir):
                node.op_type, node.domain = op, DOMAIN
                q8 += 1
            continue
        node.op_type, node.domain = OP, DOMAIN
        node.attribute.append(onnx.helper.make_attribute("mins", 0))
        count += 1
    if count:
        fuse_minimums(model)
        fuse_epilogues(model)  # the exporter's MatMulQ4 as well
    layers = 0
    if "PagedAttention" in ops and config is not None and fusable_head_dim(config.get("head_dim", 0)):
        windows = config.get("layer_windows") or [config.get("sliding_window")] * config["num_layers"]
        layers = fuse_attention(model, config["num_layers"], config["num_heads"], config["num_kv_heads"], windows)
    if kv_dtype in ("int8", "int4"):  # on the kernel's layers, else (int8, no kernel) on the graph's own attention
        if layers:
            kv_quantized(model, config["num_layers"], kv_tails, kv_dtype)
        if kv_dtype == "int8":
            kv_in_int8_graph(model)
    norms = fuse_norms(model) if "SkipRMSNorm" in ops else 0
    loras = fuse_lora(model) if "LoraDelta" in ops else 0
    lora_mlps = fuse_lora_swiglu(model) if loras else 0  # the same kernel file as LoraDelta: every build has it
    lora_qkv = fuse_lora_split(model) if loras else 0
    if loras and half_adapters:
        adapters_in_half(model)
    tails = fuse_sampling(model) if "SampleTopK" in ops else 0
    if (count or q8 or layers or norms or loras or tails) and DOMAIN not in {o.domain for o in model.opset_import}:
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return {"MatMulQ4": count, "MatMulQ8": q8, "PagedAttention": layers, "SkipRMSNorm": norms, "LoraDelta": loras,
            "LoraSwiGLU": lora_mlps, "LoraSplit": lora_qkv, "SampleTopK": tails}


def _all_128(tensor, base_dir: Path | None) -> bool:
    """Whether an initializer's bytes (in the graph, or in its external data under base_dir) are all 128."""
    import onnx

    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        data = tensor.raw_data or bytes(tensor.int32_data)
    else:
        info = {e.key: e.value for e in tensor.external_data}
        if base_dir is None:
            return False
        try:
            with open(base_dir / info["location"], "rb") as f:
                f.seek(int(info.get("offset", 0)))
                data = f.read(math.prod(tensor.dims))
        except (OSError, KeyError, ValueError):
            return False
    return bool(data) and data.count(128) == len(data)


# what a rewrite depends on besides its arguments: these modules' code (and onnx's, by its files' stamps)
REWRITE_SOURCES = ("backends/graph_fusion.py", "backends/block_layouts.py", "backends/kv_pool.py",
                   "core/kv_blocks.py", "contract.py")
CACHED_REWRITE_BYTES = 16 << 20  # a rewrite that embeds weights (portable_graph) is not worth a second copy
CACHED_REWRITES = 256  # entries kept; the least recently used go first


def rewrite_graph(graph: Path, config: dict | None = None, ops: frozenset[str] = ALL_OPS,
                  half_adapters: bool = False, kv_dtype: str = "fp32", kv_tails: bool = True,
                  weights: dict | None = None) -> tuple[bytes, dict[str, int]]:
    """The graph file rewritten by fuse() (weights stay where they are: the model's external data is
    read from the package's folder), serialized, and the counts.

    The result is kept in the cache folder (graphs/), keyed by everything it depends on: a later load
    reads it back without onnx or the rewrite, which are most of the time a load takes. Weights the
    rewrite makes (a kernel layout's portable form, on a host without the kernels) are embedded while
    they are small; past CACHED_REWRITE_BYTES, given `weights`, they stay out of the graph, and on return
    that dict holds exactly them by name, for the session to take in memory (the graph is then not cached:
    it needs them). Names already in it (the package's other graph) are taken, not converted again."""
    import json

    from runtime.backends import kv_pool

    # the tails' window is read at rewrite time (kv_quantized), so it is part of the key too
    key = _rewrite_key(graph, config, ops, half_adapters, kv_dtype, kv_tails, kv_pool.TAIL_BLOCKS)
    where = None if key is None else _rewrite_cache() / key
    if where is not None:
        try:
            found = where.with_suffix(".onnx").read_bytes(), json.loads(where.with_suffix(".json").read_text())
            where.with_suffix(".json").touch()  # used: the last to be pruned (_keep_rewrite)
            if weights is not None:
                weights.clear()  # a cached graph has its weights (only a small one is cached)
            return found
        except (OSError, ValueError):
            pass
    import onnx

    from runtime.backends.block_layouts import embed_in_memory, in_memory_names

    model = onnx.load(str(graph), load_external_data=False)
    made: dict = {} if weights is None else weights
    counts = fuse(model, config, ops, graph.parent, half_adapters, kv_dtype, kv_tails, made)
    held = in_memory_names(model)
    if weights is None or sum(made[name].nbytes for name in held) <= CACHED_REWRITE_BYTES:
        embed_in_memory(model, made, held)
        held = set()
    for name in set(made) - held:  # what this graph takes in memory, no more
        del made[name]
    data = model.SerializeToString()
    if where is not None and len(data) <= CACHED_REWRITE_BYTES and not held:
        _keep_rewrite(where, data, counts)
    return data, counts


def _rewrite_cache() -> Path:
    from runtime.aliases import cache_dir

    return cache_dir() / "graphs"


def _rewrite_key(graph: Path, config: dict | None, ops: frozenset[str], *flags: bool | str | int) -> str | None:
    """A digest of the graph's bytes, the stamps of its folder's files (the external data fuse reads),
    the arguments, this code and onnx's; None where a file cannot be read (no caching then)."""
    import hashlib
    import importlib.util
    import json

    h = hashlib.sha256()
    try:
        h.update(graph.read_bytes())
        for f in sorted(graph.parent.iterdir()):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        root = Path(__file__).resolve().parents[1]
        for name in REWRITE_SOURCES:
            h.update((root / name).read_bytes())
        spec = importlib.util.find_spec("onnx")
        onnx_dir = Path(spec.origin).parent if spec and spec.origin else None
        st = (onnx_dir / "__init__.py").stat() if onnx_dir else None
        h.update(f"onnx:{onnx_dir}:{st and st.st_mtime_ns}".encode())
    except OSError:
        return None
    h.update(json.dumps([config, sorted(ops), flags], sort_keys=True, default=str).encode())
    return h.hexdigest()[:40]


def _keep_rewrite(where: Path, data: bytes, counts: dict[str, int]) -> None:
    """Write the rewrite and its counts (counts last: their presence marks a complete entry)."""
    import json

    from runtime.package import keep_cache_file

    if not (keep_cache_file(where.with_suffix(".onnx"), data)
            and keep_cache_file(where.with_suffix(".json"), json.dumps(counts).encode())):
        return
    try:
        entries = sorted(where.parent.glob("*.json"), key=lambda f: f.stat().st_mtime_ns)
        for old in entries[:max(0, len(entries) - CACHED_REWRITES)]:
            old.unlink(missing_ok=True)
            old.with_suffix(".onnx").unlink(missing_ok=True)
    except OSError:
        pass  # a read-only cache (or a concurrent prune) only costs a later load the rewrite


def declared_fusions(graph: Path, config: dict) -> dict[str, int]:
    """What fuse() replaces in this graph with every operator: the exporter writes it into the manifest."""
    import onnx

    return fuse(onnx.load(str(graph), load_external_data=False), config, base_dir=graph.parent)


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


def fuse_lora(model) -> int:
    """Each LoRA target's delta in the LoRA graph, Add(y, MatMul(Mul(Gemm(x, A^T, transB), w), B)) with A^T
    and B graph inputs (exporter/builders/lora_path.py), becomes one ruvllm.LoraDelta(y, x, A^T, B, w), which
    computes only the adapter columns each token's w selects; a constant Mul on the delta (an AWQ output
    scale) becomes its sixth input. Returns how many."""
    from onnx import helper

    from runtime import contract as C

    nodes = list(model.graph.node)
    consumers = _consumers(nodes)
    inputs = {i.name for i in model.graph.input}
    inits = {i.name for i in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    sets = _weight_sets(model, nodes)

    def only(name: str, op_type: str):
        users = consumers.get(name, [])
        ok = len(users) == 1 and users[0].op_type == op_type and name not in graph_outputs
        return users[0] if ok else None

    removed, count = set(), 0
    for gemm in nodes:
        if gemm.op_type != "Gemm" or len(gemm.input) != 2 or gemm.input[1] not in inputs:
            continue
        if [(a.name, a.i) for a in gemm.attribute] != [("transB", 1)]:
            continue
        mul = only(gemm.output[0], "Mul")
        weights = mul and next((n for n in mul.input if n != gemm.output[0]), None)
        module = 0 if weights == C.LORA_WEIGHTS else sets.get(weights)  # a format-2 graph's one w
        matmul = module is not None and only(mul.output[0], "MatMul")
        delta = matmul and matmul.input[1] in inputs and matmul.output[0]
        scale = delta and only(delta, "Mul")  # an AWQ package's output scale (lora_path.LoraPath.apply)
        scale_init = scale and next((n for n in scale.input if n != delta and n in inits), None)
        if scale_init:
            delta = scale.output[0]
        add = delta and only(delta, "Add")
        if not add:
            continue
        base = next(n for n in add.input if n != delta)
        add.op_type, add.domain = "LoraDelta", DOMAIN
        del add.input[:]
        add.input.extend([base, gemm.input[0], gemm.input[1], matmul.input[1], C.LORA_WEIGHTS]
                         + ([scale_init] if scale_init else []))
        del add.attribute[:]
        add.attribute.extend([helper.make_attribute("scaled", int(bool(scale_init))),
                              helper.make_attribute("module", module)])
        add.name = add.name or f"lora_delta_{count}"
        removed.update((id(gemm), id(mul), id(matmul)) + ((id(scale),) if scale_init else ()))
        count += 1
    if removed:
        _drop(model, nodes, removed)
        _drop_dead(model)  # the targets' weight-set gathers
    return count


def _weight_sets(model, nodes) -> dict[str, int]:
    """The LoRA graph's per-target weights (exporter/builders/lora_path.LoraPath.mix): each Gather of
    w's sets at min(module, sets - 1), by its output -> the target's module index."""
    from onnx import numpy_helper

    from runtime import contract as C

    inits = {i.name: i for i in model.graph.initializer}
    made = {o: n for n in nodes for o in n.output}
    out = {}
    for g in nodes:
        if g.op_type != "Gather" or [(a.name, a.i) for a in g.attribute] != [("axis", 1)]:
            continue
        reshape, index = made.get(g.input[0]), made.get(g.input[1])
        if reshape is None or reshape.op_type != "Reshape" or reshape.input[0] != C.LORA_WEIGHTS:
            continue
        if index is None or index.op_type != "Min":
            continue
        module = next((inits[n] for n in index.input if n in inits), None)
        if module is not None and not module.dims:
            out[g.output[0]] = int(numpy_helper.to_array(module))
    return out


def _drop_dead(model) -> None:
    """The graph without the nodes nothing reads from (a fusion's leftovers), in one backward sweep: an ONNX
    graph's nodes are in topological order."""
    nodes = list(model.graph.node)
    live = {o.name for o in model.graph.output}
    dead = set()
    for node in reversed(nodes):
        if any(name in live for name in node.output):
            live.update(node.input)
        else:
            dead.add(id(node))
    if dead:
        _drop(model, nodes, dead)


def kv_quantized(model, num_layers: int, tails: bool = True, kv_dtype: str = "int8") -> int:
    """Each layer's KV pool inputs (past.{i}.key / .value) that only ruvllm.PagedAttention reads become
    int8 (--kv-dtype int8), or int4 packed two a byte in uint8 [kv_heads, num_blocks, block_size, head_dim /
    2] (int4), and the node takes four more inputs: the fp16 scales of each row's groups [kv_heads,
    num_blocks, block_size, n] per kind (contract.past_key_scale; int8: one per group, kv_pool.quantize_rows;
    int4: a (scale, minimum) pair per group, kv_pool.quantize_rows_int4), which the kernel multiplies back
    in, and the fp16 tails, near-exact copies of the blocks being written, every layer's in one input
    per kind (contract.KV_TAIL_KEY; kv_pool.py; the node's `layer` says which part is its own,
    `tail_blocks` how many blocks up to a query's own it reads from them), and each row's floor
    (contract.KV_EXACT_FROM), unless `tails` is False. Returns how many layers."""
    import onnx

    from runtime import contract as C
    from runtime.backends.kv_pool import TAIL_BLOCKS
    from runtime.core.kv_blocks import kv_scale_widths

    inputs = {i.name: i for i in model.graph.input}
    consumers = _consumers(model.graph.node)
    count = 0
    for layer in range(len(inputs)):
        key, value = inputs.get(C.past_key(layer)), inputs.get(C.past_value(layer))
        if key is None or value is None:
            break
        users = consumers.get(key.name, []) + consumers.get(value.name, [])
        if len(users) != 2 or users[0] is not users[1] or (users[0].domain, users[0].op_type) != (DOMAIN, "PagedAttention"):
            continue
        node = users[0]
        if list(node.input[2:4]) != [key.name, value.name] or len(node.input) != 7:
            continue
        grouping = _groups_of(key)
        if grouping is None:
            continue
        head_dim = grouping[0] * grouping[1]
        widths = kv_scale_widths(head_dim, kv_dtype)
        if tails and not count:
            for name in (C.KV_TAIL_KEY, C.KV_TAIL_VALUE):
                model.graph.input.append(_tail_input(key, name, num_layers))
            model.graph.input.append(onnx.helper.make_tensor_value_info(C.KV_EXACT_FROM, onnx.TensorProto.INT64, ["batch"]))
        for pool, name, width in ((key, C.past_key_scale(layer), widths[0]), (value, C.past_value_scale(layer), widths[1])):
            model.graph.input.append(_scales_input(pool, name, width))
            if kv_dtype == "int4":
                pool.type.tensor_type.elem_type = onnx.TensorProto.UINT8
                pool.type.tensor_type.shape.dim[3].dim_value = head_dim // 2
            else:
                pool.type.tensor_type.elem_type = onnx.TensorProto.INT8
            node.input.append(name)
        if tails:
            node.input.extend([C.KV_TAIL_KEY, C.KV_TAIL_VALUE, C.KV_EXACT_FROM])
            node.attribute.append(onnx.helper.make_attribute("layer", layer))
            node.attribute.append(onnx.helper.make_attribute("tail_blocks", TAIL_BLOCKS))
        count += 1
    return count


def _groups_of(pool) -> tuple[int, int] | None:
    """(scales per row, numbers per scale) of a pool input [kv_heads, blocks, block_size, head_dim] (None:
    head_dim not fixed)."""
    from runtime.core.kv_blocks import kv_group

    dims = list(pool.type.tensor_type.shape.dim)
    d = dims[3].dim_value if len(dims) == 4 else 0
    return (d // kv_group(d), kv_group(d)) if d > 0 else None


def _scales_input(pool, name: str, groups: int):
    """The graph input of a pool's fp16 group scales, [kv_heads, blocks, block_size, groups]."""
    from onnx import TensorProto, helper

    scales = helper.make_tensor_value_info(name, TensorProto.FLOAT16, None)
    for d in list(pool.type.tensor_type.shape.dim)[:3]:
        scales.type.tensor_type.shape.dim.add().CopyFrom(d)
    scales.type.tensor_type.shape.dim.add().dim_value = groups
    return scales


def _tail_input(pool, name: str, num_layers: int):
    """The graph input of the fp16 tails of every layer, [blocks, layers, kv_heads, block_size, head_dim],
    from a layer's pool input [kv_heads, blocks, block_size, head_dim]."""
    from onnx import TensorProto, helper

    tail = helper.make_tensor_value_info(name, TensorProto.FLOAT16, None)
    heads, blocks, size, dim = list(pool.type.tensor_type.shape.dim)
    shape = tail.type.tensor_type.shape
    shape.dim.add().CopyFrom(blocks)
    shape.dim.add().dim_value = num_layers
    for d in (heads, size, dim):
        shape.dim.add().CopyFrom(d)
    return tail


def kv_in_int8_graph(model) -> int:
    """The graph's own attention path on an int8 pool (where ruvllm.PagedAttention does not run): each
    layer's pool inputs become int8 with their groups' fp16 scales, the blocks a step gathers are cast to
    float and multiplied by their groups' scales, and this step's rows written into the gathered context
    are rounded as the pool will store them (kv_pool.quantize_rows, op for op: max |x| / 127 through fp16,
    x / s rounded to nearest even and kept within 127, times s), so that the numbers are those the
    kernel's path reads. Returns how many layers."""
    from onnx import TensorProto, helper

    from runtime import contract as C

    nodes = list(model.graph.node)
    inputs = {i.name: i for i in model.graph.input}
    consumers = _consumers(nodes)
    before: dict[int, list] = {}  # id(node) -> nodes to insert before it
    after: dict[int, list] = {}
    consts = []

    def const(name: str, value, dtype=TensorProto.FLOAT, dims=()):
        consts.append(helper.make_tensor(name, dtype, list(dims), [value] if not dims else value))
        return name

    count = 0
    for layer in range(len(inputs)):
        kinds = [(inputs.get(C.past_key(layer)), C.past_key_scale(layer)),
                 (inputs.get(C.past_value(layer)), C.past_value_scale(layer))]
        if any(pool is None for pool, _ in kinds):
            break
        plans = []
        for pool, scale_name in kinds:
            users = consumers.get(pool.name, [])
            gathers = [u for u in users if u.op_type == "Gather" and u.input[0] == pool.name]
            if len(gathers) != 1 or any(u.op_type != "Shape" for u in users if u is not gathers[0]):
                break
            gather = gathers[0]
            reshape = consumers.get(gather.output[0], [])
            scatter = len(reshape) == 1 and reshape[0].op_type == "Reshape" and consumers.get(reshape[0].output[0], [])
            if not scatter or len(scatter) != 1 or scatter[0].op_type not in ("TensorScatter", "ScatterND"):
                break
            plans.append((pool, scale_name, gather, scatter[0]))
        grouping = _groups_of(kinds[0][0])
        if len(plans) != 2 or grouping is None:
            continue
        groups, size = grouping
        i64 = TensorProto.INT64
        for pool, scale_name, gather, scatter in plans:
            out, tag = gather.output[0], f"{pool.name}.int8"
            gather.output[0] = f"{tag}.rows"
            model.graph.input.append(_scales_input(pool, scale_name, groups))
            pool.type.tensor_type.elem_type = TensorProto.INT8
            # [Hkv, B, MB, bs, D] int8 -> float, times each group's scale (a blocked DequantizeLinear computes the
            # same products but took twice as long natively, and no less in onnxruntime-web's WASM)
            after[id(gather)] = [
                helper.make_node("Cast", [f"{tag}.rows"], [f"{tag}.float"], to=TensorProto.FLOAT),
                helper.make_node("Reshape", [f"{tag}.float", const(f"{tag}.grouped", [0, 0, 0, 0, groups, size], i64, [6])],
                                 [f"{tag}.groups"]),
                helper.make_node("Gather", [scale_name, gather.input[1]], [f"{tag}.scales16"], axis=1),
                helper.make_node("Cast", [f"{tag}.scales16"], [f"{tag}.scales"], to=TensorProto.FLOAT),
                helper.make_node("Unsqueeze", [f"{tag}.scales", const(f"{tag}.last", [-1], i64, [1])], [f"{tag}.scales1"]),
                helper.make_node("Mul", [f"{tag}.groups", f"{tag}.scales1"], [f"{tag}.scaled"]),
                helper.make_node("Reshape", [f"{tag}.scaled", const(f"{tag}.rowwise", [0, 0, 0, 0, groups * size], i64, [5])],
                                 [out]),
            ]
            slot = 1 if scatter.op_type == "TensorScatter" else 2
            update, r = scatter.input[slot], f"{tag}.step"
            before[id(scatter)] = [  # this step's rows, rounded by groups as the pool will hold them
                helper.make_node("Shape", [update], [f"{r}.shape"]),
                helper.make_node("Reshape", [update, const(f"{r}.grouped", [-1, size], i64, [2])], [f"{r}.groups"]),
                helper.make_node("Abs", [f"{r}.groups"], [f"{r}.abs"]),
                helper.make_node("ReduceMax", [f"{r}.abs", const(f"{r}.axis", [-1], i64, [1])], [f"{r}.max"], keepdims=1),
                helper.make_node("Div", [f"{r}.max", const(f"{r}.127", 127.0)], [f"{r}.s32"]),
                helper.make_node("Cast", [f"{r}.s32"], [f"{r}.s16"], to=TensorProto.FLOAT16),
                helper.make_node("Cast", [f"{r}.s16"], [f"{r}.s"], to=TensorProto.FLOAT),
                helper.make_node("Greater", [f"{r}.s", const(f"{r}.zero", 0.0)], [f"{r}.pos"]),
                helper.make_node("Where", [f"{r}.pos", f"{r}.s", const(f"{r}.one", 1.0)], [f"{r}.safe"]),
                helper.make_node("Div", [f"{r}.groups", f"{r}.safe"], [f"{r}.steps"]),
                helper.make_node("Round", [f"{r}.steps"], [f"{r}.q"]),
                helper.make_node("Clip", [f"{r}.q", const(f"{r}.lo", -127.0), const(f"{r}.hi", 127.0)], [f"{r}.qc"]),
                helper.make_node("Mul", [f"{r}.qc", f"{r}.s"], [f"{r}.deq"]),
                helper.make_node("Reshape", [f"{r}.deq", f"{r}.shape"], [f"{r}.rounded"]),
            ]
            scatter.input[slot] = f"{r}.rounded"
        count += 1
    if count:
        ordered = []
        for node in nodes:
            ordered += before.get(id(node), []) + [node] + after.get(id(node), [])
        del model.graph.node[:]
        model.graph.node.extend(ordered)
        model.graph.initializer.extend(consts)
    return count


def adapters_in_half(model) -> int:
    """Declare as fp16 each adapter input (lora.*.A / .B) that only ruvllm.LoraDelta, LoraSwiGLU and
    LoraSplit read, which take either type: the deltas then read half the bytes per step. The native backend asks for it
    where the base weights are quantized, so that fp16's rounding of the adapters (~5e-4 relative) sits
    far below the base's own; an fp32 package keeps them fp32. Returns how many inputs."""
    import onnx

    from runtime import contract as C

    names = C.adapter_inputs(len(model.graph.input))  # more layers than the graph has
    consumers = _consumers(model.graph.node)
    count = 0
    for inp in model.graph.input:
        if inp.name not in names:
            continue
        users = consumers.get(inp.name, [])
        if users and all(n.domain == DOMAIN and n.op_type in ("LoraDelta", "LoraSwiGLU", "LoraSplit") for n in users):
            inp.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
            count += 1
    return count


def _lora_splits(model, parts: int):
    """The LoRA graph's Splits of one projection's output into `parts` targets along its last axis, each
    part read only by an unscaled LoraDelta, all of one input and one w. Returns the node list, an `only`
    (the single plain consumer of a tensor, else None) and (split, sizes, deltas) per match."""
    import onnx
    from onnx import numpy_helper

    nodes = list(model.graph.node)
    consumers = _consumers(nodes)
    inits = {i.name: i for i in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}

    def only(name: str, op_type: str, domain: str = ""):
        users = consumers.get(name, [])
        ok = len(users) == 1 and users[0].op_type == op_type and users[0].domain in ((domain,) if domain else ("", "ai.onnx"))
        return users[0] if ok and name not in graph_outputs else None

    def unscaled_delta(name: str):
        d = only(name, "LoraDelta", DOMAIN)
        return d if d is not None and d.input[0] == name and len(d.input) == 5 else None

    found = []
    for split in nodes:
        if split.op_type != "Split" or len(split.output) != parts or len(split.input) != 2 or split.input[1] not in inits:
            continue
        sizes = [int(v) for v in numpy_helper.to_array(inits[split.input[1]]).reshape(-1)]
        axis = next((onnx.helper.get_attribute_value(a) for a in split.attribute if a.name == "axis"), 0)
        deltas = [unscaled_delta(o) for o in split.output]
        if axis not in (1, -1) or len(sizes) != parts or not all(deltas):
            continue
        # consecutive weight sets (the kernel gives target t set module + t), or a one-set graph's (all 0)
        modules = [_attr(d, "module", 0) for d in deltas]
        in_order = modules in (list(range(modules[0], modules[0] + parts)), [0] * parts)
        if len({(d.input[1], d.input[4]) for d in deltas}) == 1 and in_order:
            found.append((split, sizes, deltas))
    return nodes, consumers, only, found


def fuse_lora_swiglu(model) -> int:
    """In the LoRA graph the MLP's Split of the gate/up output, its two LoraDelta targets, Sigmoid and two
    Muls become one ruvllm.LoraSwiGLU(y, x, A_g^T, B_g, A_u^T, B_u, w) writing silu(gate) * up: the
    epilogue MatMulQ4SwiGLU folds in the base graph, which the deltas keep out of the projection here.
    Unscaled targets only (an AWQ package's scaled up_proj keeps the separate operators). Returns how many."""
    import onnx

    nodes, consumers, only, found = _lora_splits(model, 2)
    removed, count = set(), 0
    for split, halves, (gate, up) in found:
        tail = halves[0] == halves[1] and _swiglu_tail(consumers, only, gate.output[0], up.output[0])
        if not tail:
            continue
        sig, silu, prod = tail
        fused = onnx.helper.make_node("LoraSwiGLU", [split.input[0], gate.input[1], gate.input[2], gate.input[3],
                                                     up.input[2], up.input[3], gate.input[4]], [prod.output[0]],
                                      name=f"lora_swiglu_{count}", domain=DOMAIN, scaled=0,
                                      module=_attr(gate, "module", 0))
        prod.CopyFrom(fused)
        removed.update(id(x) for x in (split, gate, up, sig, silu))
        count += 1
    if removed:
        _drop(model, nodes, removed)
    return count


def fuse_lora_split(model) -> int:
    """In the LoRA graph the attention's Split of the fused q/k/v output into three, their three LoraDelta
    targets and the Concat of q and k become one ruvllm.LoraSplit(y, x, A_q^T, B_q, A_k^T, B_k, A_v^T, B_v,
    w) writing (q+k, v), as MatMulQ4Split does in the base graph. Unscaled targets only. Returns how many."""
    import onnx

    nodes, _, only, found = _lora_splits(model, 3)
    removed, count = set(), 0
    for split, sizes, (q, k, v) in found:
        concat = only(q.output[0], "Concat")
        if concat is None or list(concat.input) != [q.output[0], k.output[0]] or only(k.output[0], "Concat") is not concat:
            continue
        if next((onnx.helper.get_attribute_value(a) for a in concat.attribute if a.name == "axis"), None) not in (1, -1):
            continue
        fused = onnx.helper.make_node("LoraSplit", [split.input[0], q.input[1], q.input[2], q.input[3], k.input[2],
                                                    k.input[3], v.input[2], v.input[3], q.input[4]],
                                      [concat.output[0], v.output[0]], name=f"lora_split_{count}", domain=DOMAIN,
                                      scaled=0, split=sizes[0] + sizes[1], module=_attr(q, "module", 0))
        concat.CopyFrom(fused)
        removed.update(id(x) for x in (split, q, k, v))
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


def fuse_sampling(model) -> int:
    """The step's sampling tail (exporter/builders: the sparse penalties' ScatterElements over the logits, Add
    of structured output's mask where the graph has one, Div by the temperature, LogSoftmax, TopK) becomes one
    ruvllm.SampleTopK, which keeps a row in one buffer instead of five passes over [rows, vocab]. The small
    operators computing the sparse values stay. Returns how many (0 or 1)."""
    import onnx

    nodes = list(model.graph.node)
    consumers = _consumers(nodes)
    producer = {name: node for node in nodes for name in node.output}
    graph_outputs = {o.name for o in model.graph.output}

    def feeding(node, i: int, op_type: str):
        """The node producing node.input[i] if it is an op_type that nothing else reads from."""
        src = producer.get(node.input[i]) if len(node.input) > i else None
        if src is None or src.op_type != op_type or src.domain not in ("", "ai.onnx"):
            return None
        private = consumers.get(src.output[0]) == [node] and src.output[0] not in graph_outputs
        return src if private else None

    count = 0
    for i, topk in enumerate(nodes):
        if (topk.op_type != "TopK" or topk.domain not in ("", "ai.onnx") or _attr(topk, "axis", -1) not in (-1, 1)
                or _attr(topk, "largest", 1) != 1 or _attr(topk, "sorted", 1) != 1):
            continue
        lsm = feeding(topk, 0, "LogSoftmax")
        div = lsm and _attr(lsm, "axis", -1) in (-1, 1) and feeding(lsm, 0, "Div")
        temperature = div and feeding(div, 1, "Unsqueeze")
        add = div and feeding(div, 0, "Add")
        mask = None
        if add:
            scatter, mask = feeding(add, 0, "ScatterElements"), add.input[1]
        else:
            scatter = div and feeding(div, 0, "ScatterElements")
        if not (temperature and scatter and _attr(scatter, "axis", 0) in (-1, 1)
                and _attr(scatter, "reduction", b"none") in (b"none", "none")):
            continue
        inputs = [*scatter.input[:3], temperature.input[0], topk.input[1]] + ([mask] if mask else [])
        fused = onnx.helper.make_node("SampleTopK", inputs, list(topk.output), name=topk.name, domain=DOMAIN)
        model.graph.node[i].CopyFrom(fused)
        count += 1
    if count:
        _drop_dead(model)
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

    attr = _attr

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
            tail = _swiglu_tail(consumers, only, *split.output)
            if tail:
                node.op_type = "MatMulQ4SwiGLU"
                node.output[0] = tail[-1].output[0]
                removed.update(id(x) for x in (split, *tail))
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


def _swiglu_tail(consumers: dict, only, gate: str, up: str) -> tuple | None:
    """(Sigmoid, Mul, Mul) computing silu(gate) * up from the tensors gate and up, when nothing else reads
    them or what is between; `only(name, op_type)` is the caller's single-consumer test."""
    users = consumers.get(gate, [])
    sig = next((u for u in users if u.op_type == "Sigmoid"), None)
    silu = sig and only(sig.output[0], "Mul")
    prod = silu and only(silu.output[0], "Mul")
    if (len(users) == 2 and silu in users and set(silu.input) == {gate, sig.output[0]} and prod
            and set(prod.input) == {silu.output[0], up} and consumers.get(up) == [prod]):
        return sig, silu, prod
    return None


def _attr(node, name: str, default=None):
    import onnx

    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


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


def fuse_attention(model, num_layers: int, num_heads: int, num_kv_heads: int, windows: list) -> int:
    """Replace each layer's attention path (pool gather, in-place write of this step's K/V, scores, Gemma
    2's soft cap, mask, softmax, weighted values) with one ruvllm.PagedAttention that reads the pool's blocks
    in place, with the layer's sliding window (windows[layer]; None: none); the nodes only that path used
    are dropped. Returns how many layers were fused: all or none (a graph that does not have the exported
    shape, e.g. a ScatterND one, is left as it is)."""
    from onnx import helper, numpy_helper

    from runtime import contract as C

    inits = {i.name: i for i in model.graph.initializer}

    def scalar(node) -> float | None:
        values = [numpy_helper.to_array(inits[n]) for n in node.input if n in inits]
        return float(values[0]) if len(values) == 1 and values[0].size == 1 else None

    def softcap(scores):
        """(the node after scores' soft cap, the cap) for Mul(1 / cap) -> Tanh -> Mul(cap), else (scores, 0)."""
        div = only(scores.output[0], "Mul")
        tanh = div and only(div.output[0], "Tanh")
        mul = tanh and only(tanh.output[0], "Mul")
        cap = mul and scalar(mul)
        if not (cap and scalar(div) and abs(scalar(div) * cap - 1.0) < 1e-6 and len(consumers[scores.output[0]]) == 1):
            return scores, 0.0
        return mul, cap

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
        capped, cap = softcap(scores) if scores else (None, 0.0)
        masked = capped and only(capped.output[0], "Add")  # scores + mask, softmax, then the weighted values:
        softmax = masked and only(masked.output[0], "Softmax")  # anything else between is not the kernel's math
        if not (out and softmax and weighted.input[0] == softmax.output[0]):
            return 0
        scale = next((a.f for a in scores.attribute if a.name == "alpha"), 1.0)
        fused.append((out, helper.make_node(
            "PagedAttention", [qk, v, C.past_key(layer), C.past_value(layer), C.BLOCK_TABLES, C.QUERY_INDEX,
                               C.POSITION_IDS], [out.output[0]], domain=DOMAIN, name=f"paged_attention_{layer}",
            num_heads=num_heads, num_kv_heads=num_kv_heads, sliding_window=int(windows[layer] or 0), scale=scale,
            softcap=float(cap))))
    replaced = {id(out): new for out, new in fused}
    nodes = [replaced.get(id(n), n) for n in nodes]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _drop_dead(model)  # what only the old attention paths computed (the masks, the index tensors, the gathers)
    return len(fused)
