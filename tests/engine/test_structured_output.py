"""Structured output on the tiny random model: whatever the weights, a finished output is JSON that matches."""
import asyncio
import json
import threading

import jsonschema
import pytest
import torch

from inferd.engine.async_engine import AsyncEngine
from inferd.engine.grammar import MAX_WHITESPACE, GrammarCompiler, GrammarMasker
from inferd.engine.request import GrammarError, ResponseFormat, SamplingParams
from tests.engine.test_engine import MODEL, assert_no_leak, make_engine, prompts, run

# nested objects, enums, arrays, required fields; every value bounded, so that a random model must finish
SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "kind", "owner", "tags", "scores"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", 7, None]},
        "owner": {"type": "object", "additionalProperties": False, "required": ["id", "admin"],
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                 "admin": {"type": "boolean"},
                                 "address": {"type": "object", "additionalProperties": False, "required": ["zip"],
                                             "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}}}}},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
        "scores": {"type": "array", "minItems": 1, "maxItems": 2,
                   "items": {"type": "object", "additionalProperties": False, "required": ["v"],
                             "properties": {"v": {"type": "integer", "minimum": -5, "maximum": 5}}}},
    },
}
SMALL = {"type": "object", "additionalProperties": False, "required": ["k"], "properties": {"k": {"enum": ["x", "y"]}}}


def engine(**kw):
    """The test engine, with whitespace runs in JSON cut to 2 characters: a random model loves whitespace, and
    24-character runs between every two tokens make the tests slow, not different."""
    e = make_engine(**kw)
    e.grammars.max_whitespace = 2
    return e


def fmt(schema: dict) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(schema))


def constrained(schema: dict | None, max_tokens: int = 480, **kw) -> SamplingParams:
    rf = fmt(schema) if schema is not None else ResponseFormat("json_object")
    return SamplingParams(max_tokens=max_tokens, response_format=rf, **kw)


def prompt(seed: int) -> list[int]:
    return prompts(1, seed)[0]


# outputs parse and validate

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_outputs_parse_and_validate_beside_free_text(temperature):
    reqs = {f"c{i}": (prompt(i), constrained(SCHEMA, temperature=temperature, seed=i)) for i in range(6)}
    reqs |= {f"f{i}": (prompt(10 + i), SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True))
             for i in range(3)}
    tokens, text, finish = run(engine(), reqs)
    for rid in (r for r in reqs if r.startswith("c")):
        assert finish[rid] == "stop", (rid, text[rid])
        value = json.loads(text[rid])
        jsonschema.validate(value, SCHEMA)
        assert list(value) == [key for key in SCHEMA["properties"] if key in value]  # in the schema's order
    assert all(finish[f"f{i}"] == "length" and len(tokens[f"f{i}"]) == 40 for i in range(3))


def test_json_object_outputs_are_objects():
    reqs = {f"o{i}": (prompt(i), constrained(None, max_tokens=150, temperature=1.0, seed=i)) for i in range(8)}
    tokens, text, finish = run(engine(), reqs)
    stopped = [rid for rid in reqs if finish[rid] == "stop"]
    assert len(stopped) >= 4, finish  # a random model's free strings may run on: those hit max_tokens
    assert all(isinstance(json.loads(text[rid]), dict) for rid in stopped)
    assert all(len(tokens[rid]) == 150 and text[rid].startswith("{") for rid in reqs if rid not in stopped)


def test_a_finished_grammar_ends_the_sequence_even_with_ignore_eos():
    reqs = {"r": (prompt(0), constrained(SMALL, temperature=1.0, seed=3, ignore_eos=True))}
    _, text, finish = run(engine(), reqs)
    assert finish["r"] == "stop" and json.loads(text["r"])["k"] in ("x", "y")


def test_max_tokens_cuts_the_json_with_finish_reason_length():
    _, text, finish = run(engine(), {"r": (prompt(0), constrained(SCHEMA, max_tokens=3, temperature=1.0))})
    assert finish["r"] == "length" and text["r"].startswith("{")


# scheduling: batches, preemption, aborts

def test_constrained_greedy_is_the_same_alone_and_batched():
    reqs = {f"c{i}": (prompt(i), constrained(SCHEMA, temperature=0.0)) for i in range(4)}
    reqs |= {f"f{i}": (prompt(20 + i), SamplingParams(max_tokens=30, temperature=0.0)) for i in range(4)}
    together, _, _ = run(engine(), reqs)
    alone = {rid: run(engine(), {rid: reqs[rid]})[0][rid] for rid in ("c2", "f1")}
    assert all(together[rid] == alone[rid] for rid in alone)


def test_seeded_constrained_sampling_is_reproducible_under_preemption():
    reqs = {f"c{i}": (prompt(i), constrained(SCHEMA, max_tokens=200, temperature=1.0, seed=i)) for i in range(6)}
    roomy, text, _ = run(engine(), reqs)
    small = engine(num_kv_blocks=60)  # 240 slots for six sequences of 100-150 tokens: preemptions
    tight, _, _ = run(small, reqs)
    assert small.scheduler.num_preemptions > 0
    assert tight == roomy
    assert all(jsonschema.validate(json.loads(t), SCHEMA) is None for t in text.values())


def test_constrained_sequences_are_not_drafted_by_speculative_decoding():
    reqs = {f"c{i}": (prompt(i), constrained(SCHEMA, temperature=0.0)) for i in range(3)}
    reqs |= {"f": (prompt(9) * 3, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))}
    plain, _, _ = run(engine(), reqs)
    spec, text, finish = run(engine(num_speculative_tokens=4), reqs)
    assert spec == plain and all(finish[f"c{i}"] == "stop" for i in range(3))


def test_abort_mid_json_frees_everything():
    e = make_engine()  # the default whitespace
    e.add_request("a", prompt(0), constrained(SCHEMA, temperature=1.0, seed=0))
    e.add_request("b", prompt(1), constrained(SCHEMA, temperature=1.0, seed=1))
    for _ in range(3):
        e.step()
    assert e.abort("a").finish_reason == "abort"
    while e.has_work():
        e.step()
    assert_no_leak(e)


# compiling

def test_whitespace_runs_are_bounded():
    tok = MODEL.tokenizer
    matcher = GrammarCompiler(tok, [2]).matcher(ResponseFormat("json_object"))
    space, brace = tok.encode(" ")[0], tok.encode("{")[0]
    assert matcher.validate_tokens([brace] + [space] * 100) == 1 + MAX_WHITESPACE


@pytest.mark.parametrize("schema", [{"type": "nonsense"}, {"type": "string", "pattern": "("},
                                    {"properties": {"a": {"$ref": "#/missing"}}}, {"minLength": "x"}])
def test_an_unusable_schema_is_a_grammar_error_and_nothing_is_queued(schema):
    e = make_engine()
    with pytest.raises(GrammarError, match="JSON schema"):
        e.add_request("r", prompt(0), constrained(schema))
    assert not e.has_work() and not e.seqs


def test_grammars_are_compiled_once_per_schema_and_the_cache_is_bounded(monkeypatch):
    compiler = GrammarCompiler(MODEL.tokenizer, [2], max_cached=2)
    compiles = []
    compile_once = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda f: compiles.append(f) or compile_once(f))
    a, b, c = fmt(SMALL), fmt(SCHEMA), ResponseFormat("json_object")
    first, second = compiler.matcher(a), compiler.matcher(a)
    assert first is not second and len(compiles) == 1  # one compile, an independent matcher per sequence
    assert first.consume_token(MODEL.tokenizer.encode("{")[0]) and not second.is_stopped()
    compiler.matcher(b), compiler.matcher(c), compiler.matcher(a)
    assert list(compiler._cache) == [c, a] and len(compiles) == 4  # a was evicted and compiled again, then b


def test_padding_logits_past_the_tokenizer_are_never_allowed():
    compiler = GrammarCompiler(MODEL.tokenizer, [2])
    masker = GrammarMasker(compiler, logits_width=400)  # the model's vocabulary pads the tokenizer's 384

    class Seq:
        grammar = compiler.matcher(fmt(SMALL))
    free = type("Free", (), {"grammar": None})()
    logits = torch.zeros(3, 400)
    masker.start([free, Seq(), free]).apply(logits)
    allowed = (logits[1] == 0).nonzero().flatten().tolist()
    assert [MODEL.tokenizer.decode([t]) for t in allowed] == ["{"]
    assert (logits[[0, 2]] == 0).all()


def test_the_async_engine_compiles_off_the_engine_thread(monkeypatch):
    e = engine()
    threads = []
    matcher = e.grammars.matcher
    monkeypatch.setattr(e.grammars, "matcher", lambda f: threads.append(threading.current_thread().name) or matcher(f))

    async def generate() -> str:
        async_engine = AsyncEngine(e)
        async_engine.start()
        try:
            outs = [o async for o in async_engine.generate("r", prompt(0), constrained(SCHEMA, seed=1))]
        finally:
            await async_engine.stop()
        assert outs[-1].finish_reason == "stop"
        return "".join(o.text for o in outs)
    jsonschema.validate(json.loads(asyncio.run(generate())), SCHEMA)
    assert len(threads) == 1 and threads[0] != "inferd-engine"
    assert_no_leak(e)
