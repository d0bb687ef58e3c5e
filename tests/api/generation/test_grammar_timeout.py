"""A grammar that compiles too slowly costs its own request a 400, never a stalled server."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from server.api.errors import APIError
from server.api.generation.structured import compile_grammar


class SlowCompiler:
    """Compiles only once released: a schema whose compilation outlasts the limit (a real one
    cannot be made slow on every machine, so the test holds the thread instead)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.finished = threading.Event()

    def compile(self, grammar: str) -> str:
        self.release.wait(30)
        self.finished.set()
        return f"compiled {grammar}"


@pytest.mark.asyncio
async def test_over_the_limit_is_a_400_and_the_compilation_finishes_in_its_thread():
    compiler = SlowCompiler()
    state = SimpleNamespace(grammars=compiler, grammar_pool=ThreadPoolExecutor(2),
                            settings=SimpleNamespace(grammar_timeout=0.05))
    with pytest.raises(APIError) as e:
        await compile_grammar(state, "g", "response_format")
    assert (e.value.status, e.value.param, e.value.code) == (400, "response_format",
                                                              "grammar_too_complex")
    assert not compiler.finished.is_set()  # answered while the compilation still ran
    compiler.release.set()
    await asyncio.to_thread(compiler.finished.wait, 30)
    state.settings.grammar_timeout = 5
    assert await compile_grammar(state, "h", "tools") == "compiled h"
    state.grammar_pool.shutdown()
