"""The catalogue's table (its repos cannot be fetched here): every alias is a valid model name,
resolves as itself, and names a Hugging Face repo id."""

from __future__ import annotations

import re

from storage.sources import CATALOGUE, DEFAULT_MODEL, Source, _alias_of, resolve


def test_every_alias_resolves_to_its_catalogue_entry():
    assert DEFAULT_MODEL in CATALOGUE
    for alias, entry in CATALOGUE.items():
        assert _alias_of(alias) == alias
        assert resolve(alias) == Source("catalogue", alias, alias)
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", entry.repo), entry.repo
    assert {"smollm3-3b", "granite-3.3-2b", "phi4-mini", "ministral-8b", "qwen3-4b",
            "llama3.1-8b"} <= set(CATALOGUE)
