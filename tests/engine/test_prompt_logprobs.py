"""Prompt logprobs (what /v1/completions' echo returns) on a tiny random model against transformers: across
prompt chunks, past the prefix cache, prompt-only requests and preemption."""
import pytest
import torch

from inferd.engine.request import SamplingParams
from tests.engine.test_engine import assert_no_leak, make_engine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf():
    from tests.tiny import tiny_hf_model
    model, _ = tiny_hf_model("llama")  # the weights tests.engine.test_engine's MODEL has
    return model


def reference(hf, prompt: list[int], top_n: int) -> tuple[list[float], list[list[int]]]:
    """transformers' logprob of each prompt token after the first, and the ids of its top_n at each position."""
    with torch.no_grad():
        lp = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    return lp.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1).tolist(), lp.topk(top_n).indices.tolist()


def prompt_logprobs(engine, rid: str, prompt: list[int], max_tokens: int, top_n: int = 3, namespace="default"):
    """Runs one request with prompt logprobs to the end: its prompt logprobs, outputs and cached prompt tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, top_logprobs=top_n,
                            prompt_logprobs=True, ignore_eos=True)
    engine.add_request(rid, prompt, params, namespace)
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
    with_prompt = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0] is outs[0], "prompt logprobs come once, in the first output"
    return outs[0].prompt_logprobs, outs, outs[-1].num_cached_tokens


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_matches(hf, ids: list[int], got, top_n: int = 3) -> None:
    ref, ref_top = reference(hf, ids, top_n)
    assert [lp.token_id for lp in got] == ids[1:]
    assert [lp.logprob for lp in got] == pytest.approx(ref, abs=1e-4)
    assert [[t for t, _ in lp.top] for lp in got] == ref_top
    for lp in got:
        assert lp.top[0][1] >= lp.logprob - 1e-6


def test_prompt_longer_than_the_chunk_matches_transformers(hf):
    engine = make_engine(max_num_batched_tokens=7)  # 30 tokens: 5 chunks
    ids = prompt(30, 1)
    got, outs, _ = prompt_logprobs(engine, "a", ids, max_tokens=2)
    assert_matches(hf, ids, got)
    assert sum(len(o.token_ids) for o in outs) == 2 and outs[-1].finish_reason == "length"
    assert_no_leak(engine)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(hf):
    engine = make_engine()
    ids = prompt(25, 2)
    engine.add_request("warm", ids, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_work():
        engine.step()
    assert engine.blocks.cached, "the first request left its prompt's blocks in the prefix cache"
    got, _, cached = prompt_logprobs(engine, "b", ids, max_tokens=1)
    assert cached == 0
    assert_matches(hf, ids, got)
    assert_no_leak(engine)


def test_max_tokens_0_computes_the_prompt_and_samples_nothing(hf):
    engine = make_engine(max_num_batched_tokens=8)
    ids = prompt(20, 3)
    got, outs, _ = prompt_logprobs(engine, "c", ids, max_tokens=0, top_n=0)
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length"
    assert outs[0].token_ids == [] and outs[0].num_output_tokens == 0
    ref, _ = reference(hf, ids, 1)
    assert [lp.logprob for lp in got] == pytest.approx(ref, abs=1e-4) and all(lp.top == [] for lp in got)
    assert_no_leak(engine)


def test_batched_with_other_requests_and_through_preemption(hf):
    """Several prompt-logprob requests beside plain ones in a pool too small for all: preempted sequences are
    recomputed, and each prompt token is still scored once."""
    engine = make_engine(num_kv_blocks=24, max_num_batched_tokens=16)  # 96 slots for 6 prompts of 30
    ids = {f"p{i}": prompt(30, 10 + i) for i in range(6)}
    for rid, p in ids.items():
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True,
                                prompt_logprobs=rid in ("p0", "p3", "p5"))
        engine.add_request(rid, p, params)
    got = {}
    while engine.has_work():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in got
                got[out.request_id] = out.prompt_logprobs
    assert engine.scheduler.num_preemptions > 0
    assert sorted(got) == ["p0", "p3", "p5"]
    for rid in got:
        ref, _ = reference(hf, ids[rid], 1)
        assert [lp.logprob for lp in got[rid]] == pytest.approx(ref, abs=1e-4)
    assert_no_leak(engine)


def test_one_token_prompt_has_no_prompt_logprobs():
    engine = make_engine()
    got, outs, _ = prompt_logprobs(engine, "d", [5], max_tokens=1)
    assert got == [] and len(outs[-1].token_ids) == 1
