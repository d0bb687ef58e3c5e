"""A model's recommended sampling settings: what a request that leaves them out gets.

Models ship them in `generation_config.json` (copied into the store at pull); vLLM applies them
by default (`--generation-config auto`), Ollama through its Modelfile parameters. A catalogue
alias whose source has none (the default model's offline GGUF) carries its model card's.
Values a sampler would refuse are left out, said once as a warning.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("localserve")

# The fields taken, each with the range a request may set it to (as the API parsers check).
FIELDS: dict[str, tuple[type, float, float]] = {
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 1e-9, 1.0),
    "top_k": (int, 0, 1 << 31),
    "min_p": (float, 0.0, 1.0),
    "repetition_penalty": (float, 1e-9, 2.0),
}
# Catalogue aliases' model-card settings, where their offline source carries none.
CATALOGUE_SAMPLING: dict[str, dict[str, float]] = {
    # SmolLM2-135M-Instruct's card: "temperature=0.2, top_p=0.9"
    "smollm2-135m": {"temperature": 0.2, "top_p": 0.9},
    "smollm2-360m": {"temperature": 0.2, "top_p": 0.9},
    "smollm2-1.7b": {"temperature": 0.2, "top_p": 0.9},
}


def sampling_defaults(folder: Path, alias: str) -> tuple[dict[str, Any], str | None]:
    """(the defaults, where they come from: "generation_config.json", "catalogue" or None)
    of the stored model in `folder` pulled as `alias`."""
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            found = checked(json.loads(gen.read_text()), gen.name)
        except (OSError, ValueError):
            log.warning("%s: unreadable; no sampling defaults from it", gen)
            found = {}
        if found:
            return found, gen.name
    if alias in CATALOGUE_SAMPLING:
        return dict(CATALOGUE_SAMPLING[alias]), "catalogue"
    return {}, None


def checked(config: Any, where: str) -> dict[str, Any]:
    """The sampling fields of a generation config that a request could set to those values."""
    if not isinstance(config, dict):
        return {}
    out: dict[str, Any] = {}
    for name, (kind, lo, hi) in FIELDS.items():
        value = config.get(name)
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or not lo <= value <= hi
                or (kind is int and value != int(value))):
            log.warning("%s: %s=%r left out (not a value a request may set)", where, name, value)
            continue
        out[name] = kind(value)
    return out


def describe(defaults: dict[str, Any], origin: str | None) -> str:
    """One line for `show` and the serve log: "temperature 0.2, top_p 0.9 (catalogue)"."""
    if not defaults:
        return "the API's (temperature 1, top_p 1)"
    return ", ".join(f"{k} {v:g}" for k, v in defaults.items()) + f" ({origin})"
