"""Constrained decoding: exact masks on the tiny tokenizer, the compile cache, and the engine
decoding under a grammar through batching, n > 1, seeds and preemption."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server.engine.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarMasks,
    closed_objects,
    json_schema_grammar,
    lark_grammar,
)
from server.engine.sequence import PRIORITY_BATCH, SamplingParams, Sequence, SequenceStatus
from tests.engine.test_engine import prompt, run
from tests.helpers import VOCAB_SIZE, make_tokenizer

EOS = 2  # <|im_end|> of the tiny tokenizer
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["a", "b"]}}, "required": ["name", "n", "kind"],
    "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB_SIZE, [EOS])


def allowed(masks, state) -> list[int]:
    return masks.masks([state])[0].nonzero().flatten().tolist()


def test_masks_allow_exactly_the_grammars_next_tokens(tokenizer, compiler):
    # `start: "he" | "h!"` over bytes plus merges, "he" being a merge (tests/helpers.py): first
    # "h" or "he"; after "h", "e" or "!"; after "h" "e" the grammar is done (the scheduler
    # stops the sequence; were it sampled once more, only EOS).
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("h", "e", "he", "!")}
    state = compiler.compile(lark_grammar('start: "he" | "h!"')).start()
    masks = GrammarMasks(VOCAB_SIZE)
    assert allowed(masks, state) == sorted([ids["h"], ids["he"]])
    state.accept(ids["h"])
    assert allowed(masks, state) == sorted([ids["e"], ids["!"]])
    state.accept(ids["e"])
    assert state.is_finished and allowed(masks, state) == [EOS]


def test_prefetched_masks_are_used_only_while_current(tokenizer, compiler):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("h", "e", "he", "!")}
    grammar = compiler.compile(lark_grammar('start: "he" | "h!"'))
    a, b = grammar.start(), grammar.start()
    masks = GrammarMasks(VOCAB_SIZE)
    masks.prefetch([a, b])
    masks.wait()
    a.accept(ids["h"])  # a moved on after its prefetch: its mask is recomputed
    assert masks.masks([a, b]).nonzero().tolist() == sorted(
        [[0, ids["e"]], [0, ids["!"]], [1, ids["h"]], [1, ids["he"]]])


def test_compiled_grammars_are_cached_by_text_and_bounded(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE, [EOS], cache_size=2)
    texts = [lark_grammar(f'start: "{c}"') for c in "xyz"]
    first = compiler.compile(texts[0])
    assert compiler.compile(texts[0]) is first and compiler.num_compiled == 1
    compiler.compile(texts[1])
    compiler.compile(texts[2])  # evicts texts[0], the least recently used
    assert compiler.compile(texts[0]) is not first and compiler.num_compiled == 4


def test_objects_that_list_their_properties_are_closed_to_others():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"const": {"properties": {}}}}},
        "b": {"type": "array", "items": {"properties": {"q": {}}}},
        "c": {"anyOf": [{"properties": {"z": {}}}, {"type": "string"}]},
        "properties": {"type": "object"},  # a property of that name, free-form
        "d": {"$ref": "#/$defs/D"}, "e": {"$ref": "#/$defs/E"}},
        "$defs": {"D": {"properties": {"d": {}}, "additionalProperties": True},
                  "E": {"properties": {"e": {}}, "patternProperties": {"^x": {}}}}}
    before = json.dumps(schema)
    closed = closed_objects(schema)
    assert json.dumps(schema) == before  # not modified in place
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert props["a"]["properties"]["x"] == {"const": {"properties": {}}}  # data, untouched
    assert props["b"]["items"]["additionalProperties"] is False
    assert props["c"]["anyOf"][0]["additionalProperties"] is False
    assert props["properties"] == {"type": "object"}
    assert closed["$defs"]["D"] == schema["$defs"]["D"]  # open where it says so
    assert closed["$defs"]["E"] == schema["$defs"]["E"]
    both = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_objects(both) == both  # closing a branch would forbid the other's keys
    for joined in ({"properties": {"a": {}}, "anyOf": [{"required": ["b"]}, {"required": ["c"]}]},
                   {"properties": {"a": {}}, "oneOf": [{"properties": {"b": {}}}]},
                   {"properties": {"a": {}}, "$ref": "#/$defs/B",
                    "$defs": {"B": {"properties": {"b": {}}}}}):
        assert closed_objects(joined) == joined  # its parts allow keys the properties omit
        json_schema_grammar(joined)  # and it compiles, as it did before objects were closed
    assert closed_objects({"type": "object"}) == {"type": "object"}  # any object (json_object)
    unlisted = {"properties": {"a": {}}, "required": ["a", "b"]}  # "b" can only be another key
    assert closed_objects(unlisted) == unlisted


@pytest.mark.parametrize("extra, more", [({}, False), ({"additionalProperties": True}, True)])
def test_the_grammar_ends_an_object_after_its_listed_properties(tokenizer, compiler, extra,
                                                                 more):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, **extra}
    state = compiler.compile(json_schema_grammar(schema)).start()
    for token_id in tokenizer.encode('{"a": 1'):
        state.accept(token_id)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (",", "}", "2")}
    next_ids = allowed(GrammarMasks(VOCAB_SIZE), state)
    assert ids["}"] in next_ids and ids["2"] in next_ids
    assert (ids[","] in next_ids) is more


@pytest.mark.parametrize("schema, words", [
    ({"type": "objekt"}, "objekt"),
    ({"type": "object", "if": {"type": "object"}}, "if"),
])
def test_a_bad_schema_is_a_grammar_error_that_names_the_problem(compiler, schema, words):
    with pytest.raises(GrammarError, match=words):
        compiler.compile(json_schema_grammar(schema))


def test_engine_output_follows_the_schema_through_batching_n_and_preemption(llama,
                                                                               tokenizer,
                                                                               compiler):
    grammar = compiler.compile(json_schema_grammar(SCHEMA))

    def params(**kw):
        return SamplingParams(max_tokens=80, grammar=grammar, **kw)

    def outputs(seqs):
        return [tokenizer.decode(s.output_token_ids, skip_special_tokens=True) for s in seqs]

    prompts = [prompt(20, 30 + i) for i in range(4)]
    solo = [Sequence(p, params(temperature=1.0, seed=i), eos_token_ids=(EOS,))
            for i, p in enumerate(prompts)]
    for s in solo:
        run(llama, [s])
    # The same requests batched with unconstrained ones, in a pool so small they preempt.
    batched = [Sequence(p, params(temperature=1.0, seed=i), priority=PRIORITY_BATCH * (i % 2),
                        eos_token_ids=(EOS,)) for i, p in enumerate(prompts)]
    free = [Sequence(prompt(20, 40 + i), SamplingParams(max_tokens=40, temperature=0.0))
            for i in range(3)]
    engine = run(llama, batched + free, num_blocks=14)
    assert engine.scheduler.num_preemptions > 0
    assert outputs(batched) == outputs(solo)
    for s, text in zip(batched, outputs(batched), strict=True):
        assert s.status == SequenceStatus.FINISHED_STOPPED
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(s.grammar is None for s in free)


def test_greedy_under_a_grammar_starts_where_the_grammar_says(llama, compiler):
    # A random model never writes JSON by itself: the first token is forced to "{".
    grammar = compiler.compile(json_schema_grammar(SCHEMA))
    s = Sequence(prompt(10, 3), SamplingParams(max_tokens=80, temperature=0.0,
                                               grammar=grammar), eos_token_ids=(EOS,))
    run(llama, [s])
    assert s.output_token_ids[0] == make_tokenizer().convert_tokens_to_ids("{")
    assert s.status == SequenceStatus.FINISHED_STOPPED
