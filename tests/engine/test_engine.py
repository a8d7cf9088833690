"""The engine on a tiny random model: batching, paging, preemption, sampling, stops."""
import pytest
import torch

from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import EngineError, SamplingParams
from tests.tiny import tiny_loaded_model

MODEL = tiny_loaded_model()


def make_engine(**kw) -> LLMEngine:
    cfg = dict(dtype="float32", max_num_seqs=64, max_num_batched_tokens=256, num_kv_blocks=256, block_size=4)
    return LLMEngine(MODEL, EngineConfig(**(cfg | kw)))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], max_steps: int = 10_000):
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    tokens = {rid: [] for rid in requests}
    text = {rid: "" for rid in requests}
    finish = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            text[out.request_id] += out.text
            if out.finished:
                finish[out.request_id] = out.finish_reason
    assert not engine.has_work(), "engine did not drain"
    assert_no_leak(engine)
    return tokens, text, finish


def assert_no_leak(engine: LLMEngine) -> None:
    """Every block free (cached blocks count as free), none referenced, the prefix cache consistent."""
    b = engine.blocks
    assert b.num_free_blocks == b.num_blocks, "KV blocks leaked"
    assert all(block.ref_count == 0 for block in b.blocks), "a free block is still referenced"
    assert sorted(b.cached.values()) == sorted(b.evictable) == sorted(k.block_id for k in b.blocks if k.hash)
    assert all(b.blocks[i].hash == h for h, i in b.cached.items())


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_64_concurrent_requests_all_finish():
    engine = make_engine(max_num_seqs=16)
    reqs = {f"r{i}": (p, greedy(8 + i % 5)) for i, p in enumerate(prompts(64))}
    tokens, _, finish = run(engine, reqs)
    assert all(finish[r] == "length" for r in reqs)
    assert all(len(tokens[f"r{i}"]) == 8 + i % 5 for i in range(64))


def test_batched_greedy_equals_one_at_a_time():
    reqs = {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts(6))}
    together, _, _ = run(make_engine(), reqs)
    alone = {rid: run(make_engine(), {rid: req})[0][rid] for rid, req in reqs.items()}
    assert together == alone


def test_preemption_under_tiny_pool_gives_same_greedy_outputs():
    reqs = {f"r{i}": (p, greedy(24)) for i, p in enumerate(prompts(8, seed=3))}
    roomy, _, _ = run(make_engine(), reqs)
    small = make_engine(num_kv_blocks=20)  # 80 slots: 8 sequences of up to 43 tokens cannot all fit
    tight, _, _ = run(small, reqs)
    assert small.scheduler.num_preemptions > 0
    assert tight == roomy


def test_request_larger_than_pool_is_rejected_not_deadlocked():
    engine = make_engine(num_kv_blocks=4)
    with pytest.raises(EngineError, match="maximum context length is 16 tokens .all its KV cache holds"):
        engine.add_request("big", list(range(3, 15)), greedy(8))
    with pytest.raises(EngineError, match="maximum context length"):
        make_engine().add_request("long", [5] * 500, greedy(100))
    assert not engine.has_work()


def test_chunked_prefill_respects_token_budget_and_matches_whole_prefill():
    reqs = {f"r{i}": (p * 3, greedy(4)) for i, p in enumerate(prompts(4))}
    engine = make_engine(max_num_batched_tokens=8)
    for rid, (ids, params) in reqs.items():
        engine.add_request(rid, ids, params)
    chunked = {rid: [] for rid in reqs}
    while engine.has_work():
        batch = engine.scheduler.schedule()
        assert 0 < batch.num_tokens <= 8
        for out in engine.run_batch(batch):
            chunked[out.request_id] += out.token_ids
    whole, _, _ = run(make_engine(), reqs)
    assert chunked == whole


def test_seed_reproducible_inside_a_mixed_batch():
    p = prompts(1, seed=7)[0]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone, _, _ = run(make_engine(), {"s": (p, seeded)})
    others = {f"o{i}": (q, SamplingParams(max_tokens=10, temperature=0.9, ignore_eos=True))
              for i, q in enumerate(prompts(5, seed=8))}
    mixed, _, _ = run(make_engine(), {"s": (p, seeded)} | others)
    assert alone["s"] == mixed["s"]
    other_seed, _, _ = run(make_engine(), {"s": (p, SamplingParams(max_tokens=16, seed=99, ignore_eos=True))})
    assert other_seed["s"] != alone["s"]


def test_top_k_1_is_greedy_and_top_p_keeps_the_top_token():
    p = prompts(1, seed=11)[0]
    ref, _, _ = run(make_engine(), {"a": (p, greedy(10))})
    top_k, _, _ = run(make_engine(), {"a": (p, SamplingParams(max_tokens=10, top_k=1, ignore_eos=True))})
    tiny_p, _, _ = run(make_engine(), {"a": (p, SamplingParams(max_tokens=10, top_p=1e-6, ignore_eos=True))})
    assert ref == top_k == tiny_p


def test_frequency_penalty_discourages_repeats():
    p = prompts(1, seed=5)[0]
    plain, _, _ = run(make_engine(), {"a": (p, greedy(40))})
    penalised, _, _ = run(make_engine(), {"a": (p, SamplingParams(max_tokens=40, temperature=0.0,
                                                                   frequency_penalty=2.0, ignore_eos=True))})
    assert len(set(penalised["a"])) > len(set(plain["a"]))


def test_logprobs_of_greedy_tokens_are_the_top_ones():
    p = prompts(1, seed=2)[0]
    engine = make_engine()
    engine.add_request("a", p, SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=3,
                                              ignore_eos=True))
    entries = []
    while engine.has_work():
        for out in engine.step():
            entries += out.logprobs
    assert len(entries) == 5
    for e in entries:
        assert len(e.top) == 3 and e.top[0][0] == e.token_id
        assert e.logprob == pytest.approx(e.top[0][1]) and e.top[0][1] >= e.top[1][1] >= e.top[2][1]


def test_stop_token_ids_and_max_tokens():
    p = prompts(1, seed=4)[0]
    ref, _, _ = run(make_engine(), {"a": (p, greedy(10))})
    stop_at = ref["a"][4]
    tokens, _, finish = run(make_engine(), {"a": (p, SamplingParams(max_tokens=10, temperature=0.0,
                                                                    stop_token_ids=[stop_at], ignore_eos=True))})
    first = ref["a"].index(stop_at)
    assert tokens["a"] == ref["a"][:first + 1] and finish["a"] == "stop"


def test_stop_string_is_cut_and_never_streamed_partially():
    p = prompts(1, seed=9)[0]
    engine = make_engine()
    _, text, _ = run(engine, {"a": (p, greedy(30))})
    full = text["a"]
    assert len(full) > 10
    stop = full[6:9]
    engine = make_engine()
    engine.add_request("a", p, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop], ignore_eos=True))
    deltas, finish = [], None
    while engine.has_work():
        for out in engine.step():
            deltas.append(out.text)
            finish = out.finish_reason
    streamed = "".join(deltas)
    assert streamed == full[:full.index(stop)] and finish == "stop"
    for i in range(1, len(deltas)):  # no prefix of what was sent ever ended in a part of the stop string
        assert stop not in "".join(deltas[:i])


def test_abort_frees_blocks_at_once():
    engine = make_engine()
    engine.add_request("a", prompts(1)[0], greedy(50))
    engine.add_request("b", prompts(1, seed=1)[0], greedy(50))
    engine.step()
    engine.step()
    assert engine.blocks.num_used_blocks > 0
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    engine.abort("b")
    assert_no_leak(engine)
    assert not engine.has_work()
    assert engine.abort("a") is None


def test_settings_that_cannot_be_honoured_are_rejected_at_start():
    with pytest.raises(ValueError, match="exceeds the model's context length 512"):
        make_engine(max_model_len=10_000)
    with pytest.raises(ValueError, match="holds no 4-token block"):
        make_engine(num_kv_blocks=None, kv_cache_gib=1e-9)


def test_small_decode_steps_can_leave_a_core_and_the_others_use_all(monkeypatch):
    assert make_engine(num_threads=2).small_step_threads == 2  # the default: all of them
    engine = make_engine(num_threads=2, small_step_threads=1, small_step_seqs=2, adapt_threads=False)
    seen, forward = [], engine.runner.run

    def run_recording_threads(batch, between=None):
        seen.append((len(batch.decodes), len(batch.prefills), torch.get_num_threads()))
        return forward(batch, between)

    monkeypatch.setattr(engine.runner, "run", run_recording_threads)
    run(engine, {f"r{i}": (ids, greedy(4 + 4 * i)) for i, ids in enumerate(prompts(3))})  # 3, 2, then 1 decoding
    assert all(t == (1 if not p and d <= 2 else 2) for d, p, t in seen)
    assert {(d, t) for d, p, t in seen if not p} == {(3, 2), (2, 1), (1, 1)}
    assert make_engine(num_threads=2).num_threads == 2  # a new engine is not held to the last step's count


def test_steps_run_on_the_cores_left_by_other_processes():
    """Under an injected contention signal (others use 0.9 of a core of two, two windows in a row) a step runs on
    one thread, the same tokens as on two; once the others leave, on two again."""
    from inferd.models.cores import CoreShare
    from tests.models.test_cores import Signal
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone, _, _ = run(make_engine(num_threads=2), {"a": (prompts(1)[0], params)})
    engine = make_engine(num_threads=2)
    signal = Signal([0, 1])
    engine.cores = CoreShare(2, signal)
    signal.measured(0.9)
    signal.measured(0.9)  # two windows in a row
    seen = []
    engine.runner.run = (lambda run_step: lambda *a: seen.append(torch.get_num_threads()) or run_step(*a))(
        engine.runner.run)
    beside, _, _ = run(engine, {"a": (prompts(1)[0], params)})
    assert beside == alone and set(seen) == {1}
    signal.measured(0.05)
    seen.clear()
    run(engine, {"b": (prompts(1)[0], params)})
    assert set(seen) == {2}
