"""What the page's Python must hold before the bundle build takes its memory snapshot (wasm/snapshot.py).

A restored Pyodide snapshot has every module that was imported, but not the wheels' files (the
file system is not part of the heap), so a module imported lazily after a restore would not be
found. Everything the page can reach is imported here first, and the tokenizer's character
tables, which do not depend on the model, are built once into the snapshot.
"""

from __future__ import annotations

import importlib
import pkgutil

# the wheels the page installs (pyodide-lock.json's "ruvllm" and its dependencies) and Pyodide's own
# Python modules the web backend imports lazily
PACKAGES = ("runtime", "jinja2", "markupsafe")
EXTRA_MODULES = ("pyodide.ffi", "json", "asyncio")
# never used in the page: the CLI (argparse alone costs ~0.1 s here), and what needs native libraries
NOT_IN_THE_PAGE = ("runtime.serve.cli", "runtime.resolve", "runtime.serve.server", "runtime.serve.bench", "runtime.backends.native",
                   "runtime.backends.kv_pool", "runtime.backends.adapter_weights", "runtime.backends.guidance",
                   "runtime.backends.block_layouts", "runtime.backends.graph_rewrite", "runtime.backends.lora_gradients", "runtime.backends.micro_lora",
                   "runtime.backends.dense_weights", "runtime.serve.feedback_api", "runtime.serve.personalization",
                   "runtime.serve.ollama_api", "runtime.serve.ollama_protocol", "runtime.serve.tokenizer_api",
                   "runtime.serve.slots_api", "runtime.serve.adapter_api", "runtime.core.kv_sessions",
                   "runtime.formats.kv_session")


def preload_modules() -> list[str]:
    """Import every module of PACKAGES that imports here; return the ones that cannot.

    Modules the page never uses are left out, and `__main__` modules, because importing one runs it.
    """
    skipped: list[str] = []
    for name in EXTRA_MODULES:
        importlib.import_module(name)

    def walk(package) -> None:  # not pkgutil.walk_packages: it imports every package it descends into, skipped or not
        for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            if info.name.rsplit(".", 1)[-1] == "__main__" or info.name.startswith(NOT_IN_THE_PAGE):
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:
                skipped.append(info.name)
                continue
            if info.ispkg:
                walk(module)

    for top in PACKAGES:
        walk(importlib.import_module(top))
    from runtime.text.pretokenize import _category_tables

    _category_tables()
    return skipped
