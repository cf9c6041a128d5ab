"""A family is a row of traits (runtime/formats/families.py) that the graph builder reads off a transformers
config: its refusals name the flag, and every row reads the config transformers itself would build."""

from __future__ import annotations

import pytest

from exporter.builders.family_config import family_for, spec_options
from runtime.errors import UnsupportedModelError
from runtime.formats.families import FAMILIES, STEP_FAMILIES


def _config(model_type: str, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, num_hidden_layers=6, **kw)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_row_refuses_what_it_does_not_compute_by_name(model_type):
    family = family_for(_config(model_type))
    assert family is FAMILIES[model_type]
    for flag in family.refuses:
        with pytest.raises(UnsupportedModelError, match=f"{model_type} with {flag}=True"):
            family_for(_config(model_type, **{flag: True}))
    with pytest.raises(UnsupportedModelError, match="activation 'relu'"):
        family_for(_config(model_type, **{family.activation_fields[0]: "relu"}))


def test_windows_and_scales_come_from_the_rows_pattern():
    """Gemma 3's five sliding layers to a global one (its config's layer_types agree with the row), Gemma 2's
    alternation, Mistral's window on every layer, Gemma's sqrt(width) embeddings; Llama none of these."""
    g3 = spec_options(FAMILIES["gemma3_text"], _config("gemma3_text", sliding_window=64))
    assert g3["layer_windows"] == (64, 64, 64, 64, 64, None) and g3["qk_norm"] and g3["sandwich_norms"]
    g2 = spec_options(FAMILIES["gemma2"], _config("gemma2", sliding_window=32))
    assert g2["layer_windows"] == (32, None) * 3 and g2["activation"] == "gelu_tanh"
    assert spec_options(FAMILIES["mistral"], _config("mistral", sliding_window=16))["sliding_window"] == 16
    gemma = _config("gemma", hidden_size=64)
    assert spec_options(FAMILIES["gemma"], gemma)["embed_scale"] == 8.0
    llama = spec_options(FAMILIES["llama"], _config("llama"))
    assert "layer_windows" not in llama and "sliding_window" not in llama and "embed_scale" not in llama
    assert {f.gguf for f in STEP_FAMILIES.values()} == set(STEP_FAMILIES) == {"llama", "qwen2", "gemma3"}
