import pytest
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
        for _ in range(10000):
            counts[accept_sampled(probs, draft, g)[0]] += 1
        assert torch.allclose(counts / counts.sum(), p, atol=0.015), (draft, counts / counts.sum())


# in the engine

def generate(engine, prompts: list[list[int]], params: SamplingParams, check=None) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
        if check is not None:
            check(engine)
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
    assert acceptance_rate(engine.speculator.stats) > 0


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


# with a draft model

def save_draft(path, num_layers: int | None = None, tokenizer=None):
    """The tiny target's own weights (its first num_layers layers when given) as a model directory."""
    import json

    from tests.tiny import tiny_hf_model, tiny_tokenizer

    model, _ = tiny_hf_model()
    if num_layers is not None:
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
    model.save_pretrained(path)
    (tokenizer or tiny_tokenizer().hf_tokenizer).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return str(path)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    (root / "same").mkdir(), (root / "one-layer").mkdir()
    return {"same": save_draft(root / "same"), "one-layer": save_draft(root / "one-layer", num_layers=1)}


def acceptance_rate(stats) -> float:
    assert stats.draft_tokens == sum(stats.drafted_by_position) > 0
    assert stats.accepted_tokens == sum(stats.accepted_by_position) <= stats.draft_tokens
    assert all(a <= d for a, d in zip(stats.accepted_by_position, stats.drafted_by_position))
    return stats.accepted_tokens / stats.draft_tokens


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


MIXED = [repetitive(30, 1), random_tokens(18, 5) + [7, 8, 9], random_tokens(11, 6), random_tokens(18, 5) + [10],
         repetitive(13, 2), [5]]


@pytest.fixture(scope="module")
def plain_mixed() -> dict[str, list[int]]:
    return generate(make_engine(), MIXED, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))


def test_greedy_output_is_identical_with_the_target_as_draft_model(drafts, plain_mixed):
    engine = make_engine(num_speculative_tokens=4, speculative_model=drafts["same"])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert generate(engine, MIXED, params) == plain_mixed
    assert generate(engine, MIXED, params) == plain_mixed  # the prompts' blocks from the prefix cache this time
    assert acceptance_rate(engine.speculator.stats) > 0.95  # the draft's KV is right wherever it came from


def test_greedy_output_is_identical_with_a_smaller_draft_model(drafts, plain_mixed):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    stats = {}
    for draft in ("one-layer", "layers:1"):
        engine = make_engine(num_speculative_tokens=3, speculative_model=drafts.get(draft, draft))
        assert generate(engine, MIXED, params, check=draft_kv_within_target_kv) == plain_mixed
        assert engine.speculator.draft_model.runner.model.kernels is engine.model.kernels  # the target's C++ ops
        stats[draft] = engine.speculator.stats
    assert acceptance_rate(stats["one-layer"]) < 1  # some drafts rejected, their KV overwritten later
    # a separate draft keeps its own KV as right as the layer-skip draft that reads the target's first layer:
    assert stats["one-layer"] == stats["layers:1"]


def draft_kv_within_target_kv(engine) -> None:
    """After a step, a separate draft never counts on its KV beyond what the target kept (rejected drafts)."""
    draft = engine.speculator.draft_model
    assert all(draft.computed.get(seq, 0) <= seq.num_computed_tokens for seq in engine.scheduler.running)


def test_draft_models_under_preemption_keep_greedy_output(drafts):
    prompts = MIXED + [random_tokens(25, 7)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    plain = generate(make_engine(num_kv_blocks=26, block_size=4), prompts, params)
    assert all(len(t) == 14 for t in plain.values())
    stats = {}
    for draft in ("same", "one-layer", "layers:1"):
        engine = make_engine(num_kv_blocks=26, block_size=4, num_speculative_tokens=3,
                             speculative_model=drafts.get(draft, draft))
        assert generate(engine, prompts, params, check=draft_kv_within_target_kv) == plain
        assert engine.scheduler.num_preemptions > 0
        stats[draft] = engine.speculator.stats
    assert acceptance_rate(stats["same"]) > 0.95  # the draft's KV survives preemption and the prefix cache
    # a separate draft keeps its own KV as right as the layer-skip draft that reads the target's first layer:
    assert stats["one-layer"] == stats["layers:1"]


def test_draft_model_samples_and_accepts_by_q(drafts):
    prompts = [repetitive(20, s) for s in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=3, ignore_eos=True)
    engine = make_engine(num_speculative_tokens=3, speculative_model=drafts["one-layer"])
    out = generate(engine, prompts, params)
    assert all(len(t) == 10 for t in out.values()) and 0 < acceptance_rate(engine.speculator.stats) < 1


def test_q_rejection_rule_keeps_the_target_distribution():
    """Drafts drawn from q, kept with min(1, p/q), else replaced from norm(max(0, p - q)): each token must
    follow p: the first, and the second wherever the first draft was kept."""
    p = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.1, 0.8]])
    g = torch.Generator().manual_seed(1)
    n = 12000
    drafted = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(2)], 1).tolist()
    counts = torch.zeros(2, 3)
    for draft in drafted:
        kept = accept_sampled(p, draft, g, q)
        counts[0, kept[0]] += 1
        if len(kept) > 1:
            counts[1, kept[1]] += 1
    assert counts[1].sum() > n / 3
    assert torch.allclose(counts / counts.sum(dim=1, keepdim=True), p[:2], atol=0.015), counts


def test_a_draft_of_another_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from tests.tiny import tiny_tokenizer

    vocab = tiny_tokenizer().hf_tokenizer.get_vocab()
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    path = save_draft(tmp_path, num_layers=1, tokenizer=HFTokenizer(models.BPE(vocab, [])))
    with pytest.raises(ValueError, match="does not share the tokenizer.*token 'a' is id"):
        make_engine(num_speculative_tokens=2, speculative_model=path)


def test_bad_draft_settings_are_refused():
    with pytest.raises(ValueError, match="shallower"):
        make_engine(num_speculative_tokens=2, speculative_model="layers:2")
    with pytest.raises(ValueError, match="layers:N"):
        make_engine(num_speculative_tokens=2, speculative_model="layers:x")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine(speculative_model="layers:1")
