"""A rewritten graph kept in the cache folder (graphs/), keyed by everything it depends on, so that a later
load reads it back without onnx or the rewrite.
"""

from __future__ import annotations

from pathlib import Path

from runtime.backends.graph_rewrite.nodes import ALL_OPS

# what a rewrite depends on besides its arguments: these modules' code (and onnx's, by its files' stamps)
REWRITE_SOURCES = ("backends/block_layouts.py", "backends/kv_pool.py", "core/kv_blocks.py", "contract.py",
                   *(f"backends/graph_rewrite/{f.name}" for f in sorted(Path(__file__).parent.glob("*.py"))))


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

    from runtime.backends.graph_rewrite import fuse
    from runtime.backends.graph_rewrite.portable import embed_in_memory, in_memory_names

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
        root = Path(__file__).resolve().parents[2]
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
