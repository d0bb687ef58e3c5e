"""Tokenizer and chat template of a stored model, from its local files.

`Tokenizer` runs the model's `tokenizer.json` through Hugging Face `tokenizers` (the backend
transformers' fast tokenizers wrap) and renders the chat template with jinja2 the way
transformers does (sandboxed, trim_blocks / lstrip_blocks, loop controls, `raise_exception`,
a non-escaping `tojson`, the special tokens as variables). Not importing transformers keeps
the server ~55 MB smaller (its import and a second copy of the vocabulary). A folder without a
`tokenizer.json` falls back to transformers' AutoTokenizer, which has the same methods.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.models import StoredModel

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class Tokenizer:
    def __init__(self, folder: Path, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {name: _content(config[name]) for name in SPECIAL_TOKENS
                               if config.get(name) is not None}
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        template_file = folder / "chat_template.jinja"
        own = config.get("chat_template") or (
            template_file.read_text() if template_file.is_file() else None)
        self.chat_template: str | None = own or chat_template
        self._compiled: tuple[str, Any] | None = None
        if self.chat_template:  # now (~25 ms), not in the first chat request
            import jinja2

            with contextlib.suppress(jinja2.TemplateError):  # a broken one fails at use
                self._compiled = (self.chat_template, compile_chat_template(self.chat_template))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of one vocabulary entry, None where it has none (transformers' name)."""
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False,
                            tools: list[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this model has no chat template: use /v1/completions")
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, compile_chat_template(self.chat_template))
        text = self._compiled[1].render(**(template_kwargs | dict(
            messages=messages, tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt, **self.special_tokens)))
        return self.encode(text, add_special_tokens=False) if tokenize else text


def compile_chat_template(source: str) -> Any:
    """A chat template compiled as transformers compiles it (sandboxed environment)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: dt.datetime.now().strftime(fmt)
    return env.from_string(source)


def _content(token: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return token["content"] if isinstance(token, dict) else str(token)


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization (for configs that ask for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                 (" 're", "'re")):
        text = text.replace(a, b)
    return text


def load_tokenizer(stored: StoredModel) -> Any:
    template = stored.manifest["tokenizer"].get("chat_template")
    if (stored.path / "tokenizer.json").is_file():
        return Tokenizer(stored.path, template)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stored.path), local_files_only=True)
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    continue_final: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of `messages` (and `tools`, for templates that render them; `template_kwargs`,
    the template's own variables such as enable_thinking) through the model's chat template,
    ready for the reply; with `continue_final`, ready to continue the final message's text
    instead (the template's text after it, its end of turn, cut off, as transformers'
    continue_final_message does). ValueError if the template does not show that text as
    given."""
    kw = dict(template_kwargs or {}) | ({"tools": tools} if tools else {})
    if not continue_final:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True, **kw)
        return tokenizer.encode(text, add_special_tokens=False)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                         **kw)
    final = messages[-1]["content"].strip()
    end = text.rfind(final) if final else -1
    if end < 0:
        raise ValueError("the chat template does not show the final message's text as given, "
                         "so it cannot be continued")
    return tokenizer.encode(text[:end + len(final)], add_special_tokens=False)


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """The tags of a chat template family's thinking block (api/generation/reasoning.py)."""

    name: str
    start: str
    end: str


REASONING_FORMATS = {"think": ReasoningFormat("think", "<think>", "</think>"),
                     "mistral": ReasoningFormat("mistral", "[THINK]", "[/THINK]"),
                     "gemma": ReasoningFormat("gemma", "<|channel>thought", "<channel|>"),
                     # gpt-oss: the analysis channel (api/generation/harmony.py splits it)
                     "harmony": ReasoningFormat("harmony", "<|channel|>analysis<|message|>",
                                                "<|end|>")}
REASONING_CHOICES = ("auto", "none", *REASONING_FORMATS)  # serve --reasoning-format


def reasoning_format(template: str, choice: str = "auto") -> ReasoningFormat | None:
    """The thinking block of a chat template: the format whose two tags it writes, or the one
    `choice` names (none: no block)."""
    if choice != "auto":
        return REASONING_FORMATS.get(choice)
    if "<|channel|>" in template:
        return REASONING_FORMATS["harmony"]
    for fmt in REASONING_FORMATS.values():
        if fmt.start in template and fmt.end in template:
            return fmt
    return None


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))
