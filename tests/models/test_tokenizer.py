"""localserve's tokenizer (HF `tokenizers` + jinja2) against transformers' AutoTokenizer on
the same folder: same chat text, same ids, same decoded text."""

from __future__ import annotations

import jinja2
import pytest

from server.models.tokenizer import Tokenizer, chat_prompt_ids
from tests.helpers import make_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "the hen"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Xin chào, bạn khỏe không?"},
     {"role": "assistant", "content": "Tôi khỏe 🎉"}, {"role": "user", "content": "then?"}],
    [{"role": "user", "content": "  spaces  and\nnew lines\t"}],
]
TEXTS = ["the hen", "Xin chào 🎉 there", "<|im_start|>user\nhi<|im_end|>", "", " a  b "]


def assert_same(ours, theirs) -> None:
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == \
                theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert chat_prompt_ids(ours, messages) == chat_prompt_ids(theirs, messages)
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == \
                    theirs.decode(ids, skip_special_tokens=skip)
        for i in theirs.encode(text):
            assert ours.convert_ids_to_tokens(i) == theirs.convert_ids_to_tokens(i)


@pytest.fixture
def folder(tmp_path):
    make_tokenizer().save_pretrained(tmp_path)
    return tmp_path


def test_same_as_transformers(folder):
    from transformers import AutoTokenizer

    assert_same(Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))


def test_template_errors_and_fallbacks(folder):
    tok = Tokenizer(folder, chat_template="{{ raise_exception('no') }}")
    assert tok.chat_template != "{{ raise_exception('no') }}"  # the folder's own comes first
    tok.chat_template = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}" \
                        "{% endif %}{{ messages | tojson }}"
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == \
        '[{"role": "user", "content": "é"}]'  # tojson does not escape
    with pytest.raises(jinja2.TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    tok.chat_template = "{{ ().__class__.__mro__ }}"  # the sandbox holds
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([])
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
