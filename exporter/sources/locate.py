"""Resolves a model source (alias, hub id, local folder, GGUF file) and loads it with transformers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from runtime.aliases import ALIASES, embedded_gguf_path, is_hub_id
from runtime.errors import RuvLLMError, UnsupportedModelError


@dataclass
class Source:
    kind: str  # "gguf" | "folder" | "hub"
    id: str  # what the user named
    path: str | None = None  # folder or GGUF file on disk
    gguf_file: str | None = None

    @property
    def load_args(self) -> tuple[str, dict]:
        if self.kind == "gguf":
            return str(Path(self.path).parent), {"gguf_file": Path(self.path).name}
        return (self.path or self.id), {}


def resolve(source: str) -> Source:
    """Map what the user typed to a Source, with a clear error for a path that does not exist."""
    if source in ALIASES:
        target = ALIASES[source]
        if target == "embedded":
            return Source("gguf", source, path=str(embedded_gguf_path()))
        source = target
    p = Path(source).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return Source("gguf", source, path=str(p.resolve()))
    if p.is_dir():
        if not (p / "config.json").exists():
            raise RuvLLMError(f"{source}: not a Hugging Face model folder (no config.json)")
        return Source("folder", source, path=str(p.resolve()))
    if p.exists():
        raise RuvLLMError(f"{source}: not a .gguf file or a model folder")
    looks_local = source.startswith((".", "/", "~")) or source.endswith(".gguf")
    if looks_local or not is_hub_id(source):
        known = ", ".join(sorted(ALIASES))
        raise RuvLLMError(f"{source}: no such file or directory (nor a hub id org/name or an alias: {known})")
    return Source("hub", source)


def _hub_error(source: Source, err: Exception) -> RuvLLMError:
    return RuvLLMError(f"cannot download {source.id!r} from the Hugging Face hub (offline or not found): "
                       f"{str(err).splitlines()[0][:200]}")


def gguf_conventions(source: Source, config):
    """What llama.cpp computes of a GGUF that transformers' config of it leaves at its defaults: a Gemma 3 file
    carries no query_pre_attn_scalar, and llama.cpp scales its scores by 1 / sqrt(head_dim) (transformers'
    default, 256, is right only where head_dim is 256)."""
    if source.kind == "gguf" and config.model_type == "gemma3_text":
        config.query_pre_attn_scalar = config.head_dim
    return config


_CONFIGS: dict = {}  # a local file's config by (path, size, mtime): an export reads it twice (3 s a time for a GGUF)


def load_config(source: Source):
    import copy

    from transformers import AutoConfig

    where, kwargs = source.load_args
    key = None
    if source.kind == "gguf":
        st = Path(source.path).stat()
        key = (str(Path(source.path).resolve()), st.st_size, st.st_mtime_ns)
        if key in _CONFIGS:
            return copy.deepcopy(_CONFIGS[key])
    try:
        config = gguf_conventions(source, AutoConfig.from_pretrained(where, **kwargs))
        if key is not None:
            _CONFIGS.clear()  # the last file's only
            _CONFIGS[key] = copy.deepcopy(config)
        return config
    except (OSError, ValueError) as err:
        if source.kind == "hub":
            raise _hub_error(source, err) from err
        if "gguf" in str(err).lower() or "architecture" in str(err).lower():
            raise UnsupportedModelError(f"{source.id}: {str(err).splitlines()[0][:300]}") from err
        raise RuvLLMError(f"{source.id}: cannot read the model config: {str(err).splitlines()[0][:300]}") from err


def load_model_and_tokenizer(source: Source):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, kwargs = source.load_args
    try:
        tok = AutoTokenizer.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
        gguf_conventions(source, model.config)
    except OSError as err:
        if source.kind == "hub":
            raise _hub_error(source, err) from err
        raise RuvLLMError(f"{source.id}: cannot load the model: {str(err).splitlines()[0][:300]}") from err
    return model.eval(), tok


def source_fingerprint(source: Source) -> str | None:
    """sha256 of the GGUF file, or of a folder's config and weight files; None for a hub id."""
    if source.kind == "hub" or not source.path:
        return None
    h = hashlib.sha256()
    p = Path(source.path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.suffix in (".json", ".safetensors", ".bin"))
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def gguf_add_bos(path: str) -> bool | None:
    """The GGUF's own add_bos_token flag (transformers' conversion ignores it)."""
    from runtime.formats.gguf_file import read_header_file

    flag = read_header_file(path).field("tokenizer.ggml.add_bos_token")
    return None if flag is None else bool(flag)
