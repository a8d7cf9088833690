import torch

from inferd.engine.spec_decode import accept_greedy, accept_sampled, propose


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
