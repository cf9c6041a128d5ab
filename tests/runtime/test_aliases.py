"""Every alias docs/CLI.md names resolves, to a model of an architecture the exporter builds."""

from __future__ import annotations

import re

from runtime.aliases import ALIAS_ARCHITECTURES, ALIASES, is_hub_id
from runtime.contract import SUPPORTED_ARCHITECTURES
from tests.conftest import ROOT


def documented_aliases() -> set[str]:
    text = (ROOT / "docs" / "CLI.md").read_text()
    start = text.index("or an alias:")
    paragraph = text[start:text.index("(hub ids", start)]
    return set(re.findall(r"`([a-z0-9-]+)`", re.sub(r"\([^)]*\)", "", paragraph)))  # not the notes in brackets


def test_documented_aliases_are_exactly_the_cli_aliases():
    assert documented_aliases() == set(ALIASES)


def test_every_alias_is_the_embedded_model_or_a_hub_id_of_a_supported_architecture():
    assert set(ALIAS_ARCHITECTURES) == set(ALIASES)
    for alias, target in ALIASES.items():
        assert target == "embedded" or is_hub_id(target), alias
        assert ALIAS_ARCHITECTURES[alias] in SUPPORTED_ARCHITECTURES, alias


def test_the_embedded_alias_resolves_offline():
    from runtime.aliases import embedded_gguf_path

    assert embedded_gguf_path().stat().st_size > 50e6
