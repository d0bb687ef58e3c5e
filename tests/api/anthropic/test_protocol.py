"""Anthropic's Messages parser alone, no server: system and turns in the chat form, sampling,
thinking budgets, prefills, and the field each refused body names."""

from __future__ import annotations

import pytest

from server.api.anthropic.protocol import parse_messages_request
from server.api.errors import APIError

VOCAB = 1000
USER = [{"role": "user", "content": "hi"}]


def refused(body, count_only: bool = False) -> APIError:
    with pytest.raises(APIError) as e:
        parse_messages_request(body, VOCAB, count_only)
    assert e.value.status == 400 and e.value.message
    return e.value


def test_a_messages_body_becomes_a_chat_turn():
    req = parse_messages_request({
        "model": "m", "max_tokens": 20, "system": "Be brief.", "messages": USER,
        "temperature": 0.3, "top_k": 5, "stop_sequences": ["END"], "stream": True,
        "metadata": {"user_id": "u"}}, VOCAB)
    assert req.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "hi"}]
    assert (req.max_tokens, req.stream, req.user, req.continue_final) == (20, True, "u", False)
    p = req.params
    assert (p.temperature, p.top_k, p.stop) == (0.3, 5, ("END",))


def test_a_final_assistant_message_is_a_prefill():
    req = parse_messages_request({"model": "m", "max_tokens": 20, "messages": [
        *USER, {"role": "assistant", "content": "The answer is"}]}, VOCAB)
    assert req.continue_final and req.messages[-1] == {"role": "assistant",
                                                        "content": "The answer is"}


def test_count_tokens_needs_no_max_tokens():
    req = parse_messages_request({"model": "m", "messages": USER}, VOCAB, count_only=True)
    assert req.max_tokens is None and req.messages == USER


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens"),
    ({"max_tokens": 10, "messages": USER, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 2000, "messages": USER,
      "thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking.budget_tokens"),
    ({"max_tokens": 10, "messages": USER, "metadata": "u"}, "metadata"),
    ({"max_tokens": 10, "messages": USER, "frobnicate": 1}, "frobnicate"),
])
def test_refused_message_bodies(fields, param):
    assert refused({"model": "m"} | fields).param == param


def test_messages_leave_what_they_cannot_set_to_the_model():
    req = parse_messages_request({"model": "m", "max_tokens": 5, "messages": USER,
                                  "top_k": 3}, VOCAB)
    assert req.left_out == {"temperature", "top_p", "min_p", "repetition_penalty"}
