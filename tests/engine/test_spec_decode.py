import torch

from inferd.engine.request import SamplingParams
from inferd.engine.spec_decode import accept_greedy, accept_sampled, propose
from tests.engine.test_engine import assert_no_leak, make_engine


def test_prompt_lookup_copies_what_followed_the_latest_ngram():
    tokens = [5, 1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    assert propose(tokens, 2, 3, 1) == [7, 8]  # the latest earlier "1 2 3"
    assert propose([1, 2, 3, 4], 3, 3, 1) == []  # nothing repeats
    assert propose([4, 5, 4], 3, 3, 1) == [5, 4]  # a 1-gram when no longer one matches


def one_hot_logits(ids: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.full((len(ids), vocab), -10.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return logits


def test_greedy_keeps_the_agreeing_prefix_and_adds_the_models_token():
    assert accept_greedy(one_hot_logits([4, 5, 6, 7]), [4, 5, 6]) == [4, 5, 6, 7]
    assert accept_greedy(one_hot_logits([4, 9, 6, 7]), [4, 5, 6]) == [4, 9]
    assert accept_greedy(one_hot_logits([1, 9, 6, 7]), [4, 5, 6]) == [1]


def test_sampled_acceptance_keeps_the_target_distribution():
    """Whatever the draft, the first token's distribution must be p (the rejection rule's promise)."""
    p = torch.tensor([0.1, 0.6, 0.3])
    probs = torch.stack([p, p])
    g = torch.Generator().manual_seed(0)
    for draft in ([0], [1], [2]):
        counts = torch.zeros(3)
        for _ in range(20000):
            counts[accept_sampled(probs, draft, g)[0]] += 1
        assert torch.allclose(counts / counts.sum(), p, atol=0.015), (draft, counts / counts.sum())


# in the engine

def generate(engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    assert_no_leak(engine)
    return out


def repetitive(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, 384, (6,), generator=g).tolist()
    return (motif * (n // 6 + 1))[:n]


def test_greedy_output_is_identical_with_speculation():
    prompts = [repetitive(40, s) for s in range(6)] + [torch.randint(3, 384, (17,)).tolist()]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = generate(make_engine(), prompts, params)
    engine = make_engine(num_speculative_tokens=4)
    assert generate(engine, prompts, params) == plain
    stats = engine.speculator.stats
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens


def test_speculation_respects_max_tokens_and_small_pools():
    prompts = [repetitive(30, s) for s in range(4)]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    plain = generate(make_engine(num_kv_blocks=24, block_size=4), prompts, params)
    spec = generate(make_engine(num_kv_blocks=24, block_size=4, num_speculative_tokens=5), prompts, params)
    assert spec == plain and all(len(t) == 9 for t in spec.values())


def test_sampled_requests_run_with_speculation():
    prompts = [repetitive(30, s) for s in range(3)]
    out = generate(make_engine(num_speculative_tokens=3), prompts,
                   SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True))
    assert all(len(t) == 20 for t in out.values())
