"""A GGUF's own sampling settings (`general.sampling.*`, written by llama.cpp's converter from the model's
generation config) as generation_config.json fields, so the runtime's defaults are the model's
(runtime/core/generation_defaults.py) whichever source the package came from."""

from __future__ import annotations

GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                 "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


def gguf_generation(path: str) -> dict:
    """The generation_config.json fields a GGUF's metadata sets ({} for none)."""
    import gguf

    reader = gguf.GGUFReader(path)
    out = {}
    for key, name in GGUF_SAMPLING.items():
        field = reader.fields.get(key)
        if field is not None and field.data:
            value = field.parts[field.data[0]][0].item()
            out[name] = int(value) if name == "top_k" else float(value)
    return out
