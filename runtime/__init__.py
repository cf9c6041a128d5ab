"""RuvLLM's runtime: one engine for the server (onnxruntime) and the page (Pyodide)."""

from __future__ import annotations


def load(model: str | None = None, device: str = "cpu", threads: int | None = None, **options):
    """A native Engine for `model` as the CLI takes it: a package folder, an alias, a hub id, a .gguf file or a
    Hugging Face folder (the last three exported once into the cache); None: the embedded SmolLM2-135M.
    options: EngineConfig fields (kv_memory, max_num_seqs, ...)."""
    from runtime.core.engine import Engine
    from runtime.resolve import resolve_package

    return Engine.from_package(resolve_package(model), device=device, threads=threads, **options)
