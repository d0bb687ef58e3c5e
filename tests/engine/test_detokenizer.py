"""Incremental detokenization with a byte-level tokenizer: multi-byte characters arrive one
byte per token, so every emitted piece must still be whole UTF-8."""

from __future__ import annotations

import pytest

from server.engine.detokenizer import IncrementalDetokenizer
from tests.helpers import make_tokenizer

TEXTS = [
    "Xin chào, tôi là một trợ lý. Hà Nội là thủ đô của Việt Nam.",
    "emoji 🎉👍🏽 and 家族 👨‍👩‍👧 done",
    "the inn on the river",
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def stream(tok, text, stop=()):
    ids = tok(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok, stop)
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    return pieces, d


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_join_to_the_text(tok, text):
    pieces, _ = stream(tok, text)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len([p for p in pieces if p]) > 5  # really incremental


def test_stop_string_is_never_streamed(tok):
    pieces, d = stream(tok, "Hello world. STOP here and more", stop=("STOP",))
    assert "".join(pieces) == "Hello world. "
    assert d.stopped_by == "STOP"
    assert all("S" not in p for p in pieces)


def test_partial_stop_is_held_back_then_released(tok):
    ids = tok("say ST then go", add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok, ("STOP",))
    out = ""
    held_seen = False
    for i in ids:
        out += d.add(i)
        if d.text.endswith("ST"):  # could still become "STOP": nothing past "say " is out
            assert out == "say "
            held_seen = True
    assert held_seen
    out += d.flush()
    assert out == "say ST then go" and d.stopped_by is None


def test_stop_string_inside_multibyte_text(tok):
    pieces, d = stream(tok, "Việt Nam 🎉 kết thúc", stop=("🎉",))
    assert "".join(pieces) == "Việt Nam " and d.stopped_by == "🎉"


def test_earliest_of_several_stops_wins(tok):
    pieces, d = stream(tok, "one two three", stop=("three", "two"))
    assert "".join(pieces) == "one " and d.stopped_by == "two"


def test_character_cut_off_at_the_end_is_dropped(tok):
    ids = tok("ok 🎉", add_special_tokens=False).input_ids  # the emoji is 4 byte tokens
    d = IncrementalDetokenizer(tok)
    out = "".join(d.add(i) for i in ids[:-2])  # max_tokens ends inside the emoji
    assert out + d.flush() == "ok "
