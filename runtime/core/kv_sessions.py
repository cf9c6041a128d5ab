"""Saved KV sessions: a conversation's cached K/V blocks written to a file and read back into the prefix cache,
so a long system prompt or document is prefilled once across restarts (llama.cpp's slot save and restore).

A session holds the full blocks of a token sequence that the prefix cache still has (runtime/formats/kv_session.py
lays out the file). Restoring parks blocks under the same chained prefix keys and writes the K/V into them, so
the next request that begins with those tokens hits them as it would have hit the live cache: the same K/V the
same package and pool computed, the same tokens after. A file from another package or pool layout is refused
by name. The caller keeps steps from running meanwhile (AsyncEngine holds its lock).
"""

from __future__ import annotations

import time
from pathlib import Path

from runtime.errors import RequestError
from runtime.formats import kv_session


def identity(engine) -> dict:
    """What the K/V of this engine's pool depend on: the package's weights (and graphs), the pool's layout."""
    files = engine.pkg.manifest.get("files", {})
    cfg = engine.pkg.config
    try:
        layout = engine.backend.kv_block_layout()
    except RuntimeError as err:
        raise RequestError(f"saved sessions: {err}") from None
    return {"package": engine.pkg.name,
            "weights": {name: f["sha256"] for name, f in sorted(files.items()) if name.endswith((".onnx", ".data"))},
            "kv_dtype": engine.backend.info().kv_dtype, "block_size": engine.block_size,
            "num_layers": cfg["num_layers"], "kv_heads": cfg["num_kv_heads"], "head_dim": cfg["head_dim"], **layout}


def save(engine, path: str | Path, tokens: list[int], adapter: str | None = None) -> dict:
    """Write the cached full blocks that begin `tokens` to `path`: {"tokens": saved, "bytes": written,
    "seconds": ...}. Blocks the cache evicted (or never held: a partial last block) are not saved."""
    if adapter:
        raise RequestError(f"saved sessions hold the base model's K/V; these tokens were computed with adapter "
                           f"{adapter!r}")
    started = time.perf_counter()
    header = identity(engine)
    run = engine.scheduler.cached_run(tokens)
    saved = tokens[:len(run) * engine.block_size]
    written = kv_session.write(path, {**header, "adapter": None, "tokens": saved},
                               engine.backend.read_kv_blocks([block for _, block in run]))
    return {"tokens": len(saved), "bytes": written, "seconds": time.perf_counter() - started}


def restore(engine, path: str | Path) -> dict:
    """Read a session into the prefix cache: {"tokens": cached now, "restored": tokens written, "bytes": read,
    "seconds": ...}; RequestError naming what differs for a file of another package or pool."""
    started = time.perf_counter()
    try:
        header, offset = kv_session.read_header(path)
        here = identity(engine)
        differ = kv_session.mismatches(header, here)
        if differ:
            raise RequestError(f"{Path(path).name} was saved from package {header.get('package')!r} and differs from "
                               f"{here['package']!r} on this server in {', '.join(differ)}")
        blocks = kv_session.read_blocks(path, header, offset)
    except (OSError, kv_session.SessionFileError) as err:
        raise RequestError(f"cannot restore the session: {err}") from None
    tokens = header["tokens"]
    parked = engine.scheduler.park_blocks(tokens)
    try:
        engine.backend.write_kv_blocks([block for _, block in parked], [blocks[j] for j, _ in parked])
    except Exception:
        engine.scheduler.forget_prompt_blocks([block for _, block in parked])
        raise
    cached = len(engine.scheduler.cached_run(tokens)) * engine.block_size
    return {"tokens": cached, "restored": len(parked) * engine.block_size, "token_ids": tokens[:cached],
            "bytes": sum(len(b) for b in blocks), "seconds": time.perf_counter() - started}
