"""What a request gets for the sampling fields it leaves out: the model's own settings, else a chat default.

Small models decoded greedily fall into loops, so a request that names no temperature samples, as chat
UIs do (llama.cpp's server, Ollama, LM Studio): the model's `generation_config.json` (an HF source's own,
or a GGUF's `general.sampling.*`, written there at export) where it sets a field, else CHAT_DEFAULTS
(llama.cpp's). A field the caller gives always wins; `temperature: 0` is greedy as ever. The CLI, the
server, the Ray ingress and the page all resolve through `request_defaults`.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.core.request_fields import SAMPLING_FIELDS
from runtime.core.sampling import check_range
from runtime.errors import RequestError

# both from the fields' one declaration (runtime/core/request_fields.py)
CHAT_DEFAULTS: dict[str, float | int] = {f.name: f.chat for f in SAMPLING_FIELDS if f.chat is not None}
# generation_config.json's sampling fields and transformers' own default for each: a field equal to that
# default says nothing about the model
MODEL_FIELDS: dict[str, float | int | None] = {f.name: f.hf_default for f in SAMPLING_FIELDS if f.model}


def model_sampling(generation_config: dict | None) -> dict:
    """The sampling fields a generation config sets (beyond transformers' defaults); out-of-range or
    mistyped values are ignored rather than refused: they are the model author's, not the caller's."""
    out: dict = {}
    for name, library_default in MODEL_FIELDS.items():
        value = (generation_config or {}).get(name)
        if value is None or value == library_default or isinstance(value, bool):
            continue
        if name == "top_k" and (not isinstance(value, int) or value == 0):  # 0: no limit, as unset
            continue
        try:
            check_range(name, value)
        except RequestError:
            continue
        out[name] = value
    return out


def package_sampling(package_dir: str | Path, manifest: dict) -> dict:
    """model_sampling of a package's generation_config.json ({} when it has none or it is unreadable)."""
    name = manifest.get("generation_config")
    if not name:
        return {}
    try:
        data = json.loads((Path(package_dir) / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return model_sampling(data if isinstance(data, dict) else None)


def package_defaults(package) -> dict:
    """A ModelPackage's request defaults: CHAT_DEFAULTS under its own settings (the engine's and the Ray
    ingress's alike)."""
    return request_defaults(package_sampling(package.path, package.manifest))


def request_defaults(model: dict | None = None, given: dict | None = None) -> dict:
    """The defaults of a request's sampling fields: CHAT_DEFAULTS, then the model's, then `given` (the
    server's or CLI's own flags, None for a flag not given)."""
    return {**CHAT_DEFAULTS, **(model or {}), **{k: v for k, v in (given or {}).items() if v is not None}}
