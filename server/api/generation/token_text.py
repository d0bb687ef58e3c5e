"""Token ids as the strings and bytes OpenAI's logprob objects carry."""

from __future__ import annotations

import functools
from typing import Any

from server.models.tokenizer import byte_to_unicode


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable character -> byte map, built once (read only)."""
    return {c: b for b, c in byte_to_unicode().items()}


class TokenText:
    """Token strings and bytes for logprobs (byte-level BPE tokens map back to raw bytes; a
    token that is not whole UTF-8 reads `bytes:\\xe2\\x80`, as OpenAI writes it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder = _byte_decoder()  # every request built it: ~0.4 ms each

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            if piece and all(c in self._byte_decoder for c in piece):
                raw = bytes(self._byte_decoder[c] for c in piece)
            else:
                raw = self.tokenizer.decode([token_id]).encode()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: OpenAI's escaped form
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, list(raw))
        return hit

    def entries(self, logprobs: list) -> list[dict[str, Any]]:
        """An engine chunk's (token, logprob, top alternatives) as OpenAI's logprob objects
        (chat's `logprobs.content`, the Responses API's output_text `logprobs`)."""
        out = []
        for token_id, lp, tops in logprobs:
            text, raw = self(token_id)
            out.append({"token": text, "logprob": lp, "bytes": raw,
                        "top_logprobs": [{"token": self(t)[0], "logprob": v,
                                          "bytes": self(t)[1]} for t, v in tops]})
        return out
