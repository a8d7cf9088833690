"""The prefix cache on a tiny random model: hits give the same tokens, namespaces never mix, LRU eviction,
shared blocks under abort and preemption. block_size is 4 throughout."""
import pytest
import torch

from inferd.engine.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.request import SamplingParams
from inferd.engine.sequence import Sequence
from tests.engine.test_engine import assert_no_leak, greedy, make_engine, run

BS = 4


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_one(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
            namespace: str = "default") -> tuple[list[int], int]:
    """Runs one request to the end; its tokens and the cached prompt tokens it reported."""
    engine.add_request(rid, prompt, params, namespace)
    out_tokens, cached = [], None
    while engine.has_work():
        for out in engine.step():
            out_tokens += out.token_ids
            cached = out.num_cached_tokens
    assert_no_leak(engine)
    return out_tokens, cached


def cached_tokens(engine: LLMEngine, prompt: list[int], namespace: str = "default") -> int:
    """What a lookup would hit now, without running anything."""
    seq = Sequence("probe", prompt, greedy(1), cache_namespace=namespace,
                   num_public_tokens=engine._public_prefix_len(prompt))
    return len(engine.blocks.cached_prefix(seq)) * BS


# hits

def test_hit_gives_the_same_greedy_tokens_as_no_cache():
    doc = tokens(30, seed=1)
    questions = [tokens(5 + i, seed=10 + i) for i in range(4)]
    cold = make_engine(enable_prefix_caching=False)
    warm = make_engine()
    for i, q in enumerate(questions):
        expected, cached = run_one(cold, f"c{i}", doc + q, greedy(12))
        assert cached == 0
        got, cached = run_one(warm, f"w{i}", doc + q, greedy(12))
        assert got == expected
        assert cached == (0 if i == 0 else 28)  # 7 full blocks of the 30-token document
    assert cold.blocks.num_query_tokens == 0 and not cold.blocks.cached
    assert warm.blocks.num_hit_tokens == 3 * 28


def test_the_last_prompt_token_is_always_computed():
    engine = make_engine()
    prompt = tokens(16, seed=2)  # exactly 4 blocks
    first, _ = run_one(engine, "a", prompt, greedy(6))
    again, cached = run_one(engine, "b", prompt, greedy(6))
    assert cached == 12 and again == first
    expected, _ = run_one(make_engine(enable_prefix_caching=False), "c", prompt[:13], greedy(6))
    assert run_one(engine, "d", prompt[:13], greedy(6)) == (expected, 12)  # a one-token prompt chunk


def test_blocks_filled_during_decode_are_cached():
    engine = make_engine()
    prompt = tokens(10, seed=3)
    out, _ = run_one(engine, "a", prompt, greedy(14))  # 10 + 13 computed tokens: 5 full blocks
    follow_up = prompt + out + tokens(3, seed=4)
    _, cached = run_one(engine, "b", follow_up, greedy(2))
    assert cached == 20


def test_prefix_caching_off_never_hits():
    engine = make_engine(enable_prefix_caching=False)
    prompt = tokens(20, seed=5)
    for rid in "ab":
        assert run_one(engine, rid, prompt, greedy(3))[1] == 0
    assert engine.blocks.num_hit_tokens == engine.blocks.num_query_tokens == 0


# namespaces

def test_one_namespace_never_hits_another():
    engine = make_engine()
    prompt = tokens(24, seed=6)
    run_one(engine, "a1", prompt, greedy(4), namespace="tenant-a")
    assert run_one(engine, "b1", prompt, greedy(4), namespace="tenant-b")[1] == 0
    assert run_one(engine, "a2", prompt, greedy(4), namespace="tenant-a")[1] == 20
    assert run_one(engine, "d1", prompt, greedy(4))[1] == 0  # no header: namespace "default"
    assert cached_tokens(engine, prompt, "public") == 0  # a tenant named "public" is not the public namespace


def test_public_prefixes_are_shared_by_all_namespaces_and_nothing_after_them():
    system = tokens(10, seed=7)  # 2 full blocks are public; the block holding tokens 8..11 is not
    engine = make_engine(public_prefixes=[system, system[:2] + [5]])
    question = tokens(14, seed=8)
    run_one(engine, "a", system + question, greedy(3), namespace="tenant-a")
    assert cached_tokens(engine, system + question, "tenant-b") == 8
    assert cached_tokens(engine, system + question, "tenant-a") == 20
    assert cached_tokens(engine, tokens(24, seed=9), "tenant-b") == 0
    expected, _ = run_one(make_engine(enable_prefix_caching=False), "x", system + question, greedy(6))
    assert run_one(engine, "b", system + question, greedy(6), namespace="tenant-b") == (expected, 8)


# eviction

def test_lru_eviction_only_when_the_pool_needs_blocks():
    engine = make_engine(num_kv_blocks=12)
    a, b, c = tokens(16, seed=10), tokens(16, seed=11), tokens(31, seed=12)
    run_one(engine, "a", a, greedy(1))  # 4 blocks cached
    run_one(engine, "b", b, greedy(1))  # 4 more; 4 never-used blocks stay free
    assert engine.blocks.num_evictions == 0 and len(engine.blocks.cached) == 8
    assert run_one(engine, "a2", a, greedy(1))[1] == 12  # a's first 3 blocks become the most recently used
    run_one(engine, "c", c, greedy(1))  # 8 blocks: 4 free ones, then the 4 least recently used cached ones
    assert engine.blocks.num_evictions == 4
    assert cached_tokens(engine, a) == 12  # still cached
    assert cached_tokens(engine, b) == 4  # lost its tail: released before a's head was used again
    assert cached_tokens(engine, c) == 28


# sharing, abort, preemption

def test_two_running_sequences_share_prefix_blocks_with_refcounts():
    doc = tokens(20, seed=13)
    engine = make_engine()
    engine.add_request("a", doc + [7], greedy(20))
    engine.step()  # a's prompt computed: 5 full blocks cached while a still runs
    engine.add_request("b", doc + [9, 9], greedy(8))
    engine.step()
    a, b = engine.seqs["a"], engine.seqs["b"]
    assert b.num_cached_tokens == 20 and a.block_table[:5] == b.block_table[:5]
    assert [engine.blocks.blocks[i].ref_count for i in a.block_table[:6]] == [2, 2, 2, 2, 2, 1]
    engine.abort("a")
    assert [engine.blocks.blocks[i].ref_count for i in b.block_table[:5]] == [1] * 5
    while engine.has_work():
        engine.step()
    assert_no_leak(engine)
    expected, _ = run_one(make_engine(enable_prefix_caching=False), "b", doc + [9, 9], greedy(8))
    assert b.output_token_ids == expected


def test_same_prompt_in_one_step_computes_twice_and_caches_once():
    prompt = tokens(18, seed=14)
    engine = make_engine()
    together, _, _ = run(engine, {"a": (prompt, greedy(5)), "b": (prompt, greedy(5))})
    assert together["a"] == together["b"]
    assert len(engine.blocks.cached) == 5 and engine.blocks.num_hit_tokens == 0


def test_abort_mid_prefill_caches_only_computed_blocks():
    prompt = tokens(30, seed=15)
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request("a", prompt, greedy(4))
    engine.step()
    engine.step()  # 16 tokens computed
    engine.abort("a")
    assert_no_leak(engine)
    assert cached_tokens(engine, prompt) == 16
    expected, _ = run_one(make_engine(enable_prefix_caching=False), "x", prompt, greedy(4))
    assert run_one(engine, "b", prompt, greedy(4)) == (expected, 16)


def test_preemption_with_shared_prefixes_gives_same_greedy_outputs():
    doc = tokens(12, seed=16)
    reqs = {f"r{i}": (doc + tokens(3 + i, seed=20 + i), greedy(24)) for i in range(8)}
    roomy, _, _ = run(make_engine(enable_prefix_caching=False), reqs)
    small = make_engine(num_kv_blocks=20)
    tight, _, _ = run(small, reqs)
    assert small.scheduler.num_preemptions > 0 and small.blocks.num_hit_tokens > 0
    assert tight == roomy


def test_an_empty_public_prefix_is_rejected():
    with pytest.raises(ValueError, match="public prefix must hold at least one token"):
        EngineConfig(public_prefixes=[[1, 2], []])
