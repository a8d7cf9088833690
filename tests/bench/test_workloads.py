"""Workloads built with the real SmolLM2 tokenizer: exact lengths as the server counts them."""
import json

import pytest

from inferd.bench.errors import WorkloadError
from inferd.bench.tokenizer import PromptCounter, load_tokenizer, word_pool
from inferd.bench.trace import read_trace
from inferd.bench.workloads import WorkloadConfig, build_requests
from inferd.models.loader import default_model_path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def pool(tokenizer):
    return word_pool(tokenizer)


def server_prompt_len(tokenizer, api: str, text: str) -> int:
    """What inferd's API computes (api/app.py), written out independently."""
    if api == "chat":
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return len(tokenizer.encode(rendered, add_special_tokens=False))
    return len(tokenizer.encode(text, add_special_tokens=True))


# synthetic

@pytest.mark.parametrize("api,input_tokens", [("chat", 31), ("chat", 256), ("completions", 1), ("completions", 300)])
def test_synthetic_lengths_are_exact(tokenizer, pool, api, input_tokens):
    config = WorkloadConfig(input_tokens=input_tokens, output_tokens=7, seed=5)
    requests = build_requests(config, PromptCounter(tokenizer, api), pool, 20)
    assert len(requests) == 20 and len({r.text for r in requests}) == 20
    for r in requests:
        assert r.input_tokens == input_tokens == server_prompt_len(tokenizer, api, r.text)
        assert r.max_tokens == 7 and r.cancel_after_chunks is None


def test_input_shorter_than_the_chat_format_is_refused(tokenizer, pool):
    with pytest.raises(WorkloadError, match="prompt format alone takes 30 tokens"):
        build_requests(WorkloadConfig(input_tokens=30), PromptCounter(tokenizer, "chat"), pool, 1)


def test_cancel_fraction_marks_exactly_that_share(tokenizer, pool):
    config = WorkloadConfig(input_tokens=40, output_tokens=8, cancel_fraction=0.25)
    requests = build_requests(config, PromptCounter(tokenizer, "chat"), pool, 12)
    assert sorted(r.cancel_after_chunks for r in requests if r.cancel_after_chunks) == [4, 4, 4]


# shared prefix

def test_shared_prefix_documents_interleaved(tokenizer, pool):
    config = WorkloadConfig("shared-prefix", num_documents=3, document_tokens=100, questions_per_document=2,
                            question_tokens=8)
    counter = PromptCounter(tokenizer, "chat")
    requests = build_requests(config, counter, pool, 10**9)
    assert [r.document for r in requests] == [0, 1, 2, 0, 1, 2]
    docs = {r.document: r.text.split("\n\nQuestion")[0] for r in requests}
    assert all(len(tokenizer.encode(d, add_special_tokens=False)) == 100 for d in docs.values())
    assert len(set(docs.values())) == 3 and len({r.text for r in requests}) == 6
    assert all(r.text.startswith(docs[r.document]) for r in requests)
    assert all(r.input_tokens == server_prompt_len(tokenizer, "chat", r.text) for r in requests)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r.text}]),
                            add_special_tokens=False) for r in (requests[0], requests[3])]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shared >= 100 + 30 - 4  # template head + the document: a prefix cache can reuse it


# trace replay

def write_trace(tmp_path, lines: list) -> object:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_trace_replay(tmp_path, tokenizer, pool):
    path = write_trace(tmp_path, [{"arrival_offset_s": 1.5, "input_tokens": 50, "output_tokens": 3},
                                  {"arrival_offset_s": 0.0, "text": "What is a cat?", "output_tokens": 9}, ""])
    config = WorkloadConfig("trace", trace_path=path)
    requests = build_requests(config, PromptCounter(tokenizer, "completions"), pool, 10**9)
    assert [(r.arrival_offset_s, r.max_tokens) for r in requests] == [(0.0, 9), (1.5, 3)]
    assert requests[0].text == "What is a cat?" and requests[1].input_tokens == 50


def test_a_trace_line_may_hold_a_unicode_line_separator(tmp_path, tokenizer, pool):
    text = "one\u2028two\x85three"
    path = write_trace(tmp_path, [json.dumps({"arrival_offset_s": 0.0, "text": text, "output_tokens": 2},
                                             ensure_ascii=False)])
    assert [e.text for e in read_trace(path)] == [text]


@pytest.mark.parametrize("line,message", [
    ("{not json", r"trace.jsonl:1: not JSON"),
    ([1, 2], "expected a JSON object"),
    ({"arrival_offset_s": 0, "output_tokens": 3}, "exactly one of 'input_tokens' and 'text'"),
    ({"arrival_offset_s": 0, "input_tokens": 5, "text": "x", "output_tokens": 3}, "exactly one of"),
    ({"arrival_offset_s": -1, "input_tokens": 5, "output_tokens": 3}, "'arrival_offset_s' is out of range"),
    ({"arrival_offset_s": 0, "input_tokens": 5.5, "output_tokens": 3}, "'input_tokens' must be a whole number"),
    ({"arrival_offset_s": 0, "input_tokens": 5, "output_tokens": 0}, "'output_tokens' is out of range"),
    ({"arrival_offset_s": 0, "prompt": "x", "output_tokens": 3}, r"unknown fields \['prompt'\]"),
])
def test_trace_errors_name_the_line(tmp_path, line, message):
    path = write_trace(tmp_path, [line])
    with pytest.raises(WorkloadError, match=message):
        read_trace(path)


def test_missing_trace(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        read_trace(tmp_path / "nope.jsonl")
