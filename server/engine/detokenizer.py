"""Incremental detokenization: UTF-8 safe, and stop strings never streamed.

Text is decoded from a sliding window of tokens (prefix_offset..end) and only the part past the
previous window is emitted; a window that ends in U+FFFD is an incomplete multi-byte character
and waits for the next token. Emitted text also holds back any tail that could be the start of
a stop string, so a stop string never reaches the client.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), skip_special_tokens=True,
                 shown: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.shown = frozenset(shown)  # special tokens written out all the same (tool markup)
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: a few tokens of context for the decoder
        self.read_offset = 0  # tokens already turned into text
        self.text = ""  # all decoded text (stop string excluded once found)
        self.num_emitted = 0  # characters of `text` already returned
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        if not self.shown or self.shown.isdisjoint(ids):  # every token, most with none shown
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        parts, run = [], []
        for token_id in ids:  # the runs between shown tokens, and each shown token's text
            if token_id in self.shown:
                parts += [self._decode(run), self.tokenizer.decode([token_id])]
                run = []
            else:
                run.append(token_id)
        return "".join(parts) + self._decode(run)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that is now safe to emit (maybe "")."""
        if self.stopped_by is not None:
            return ""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end: whatever was held back (a partial stop string that never completed).
        A character cut off by the end (max_tokens mid-character) is dropped, never sent as
        U+FFFD."""
        if self.stopped_by is None and self.read_offset < len(self.token_ids):
            full = self._decode(self.token_ids[self.prefix_offset:])
            prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            self.text += full[len(prefix):].rstrip("\ufffd")
            self.read_offset = len(self.token_ids)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        end = len(self.text)
        if self.stop and self.stopped_by is None:
            # A stop string may end inside the new text; search from where it could begin.
            start = max(0, self.num_emitted - max(len(s) for s in self.stop))
            hits = [(self.text.find(s, start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self.text, self.stopped_by = self.text[:i], s
                end = i
            elif not final:
                end -= self._held_back()
        new = self.text[self.num_emitted:end]
        self.num_emitted = max(self.num_emitted, end)
        return new

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest
