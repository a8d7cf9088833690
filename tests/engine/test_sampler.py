import pytest
import torch

from inferd.engine.request import SamplingParams
from inferd.engine.sampler import Sampler
from inferd.engine.sequence import Sequence


def seqs(n: int, **params) -> list[Sequence]:
    return [Sequence(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=4, **params)) for i in range(n)]


def test_sampled_tokens_follow_the_distribution_and_never_take_a_masked_token():
    p = torch.tensor([0.0, 0.1, 0.6, 0.0, 0.3, 0.0])  # zeros at both ends and inside: masked (-inf) logits
    logits = p.log().expand(4000, -1).contiguous()
    sampler = Sampler(seed=0)
    tokens, _ = sampler(logits, seqs(4000, temperature=1.0))
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float()
    assert counts[[0, 3, 5]].sum() == 0
    assert torch.allclose(counts / counts.sum(), p, atol=0.025), counts / counts.sum()


@pytest.mark.parametrize("u", [0.0, 1 - 2 ** -53])  # the ends of torch.rand's [0, 1)
def test_draws_at_the_ends_of_the_unit_interval_take_tokens_with_probability(monkeypatch, u):
    inf = float("inf")
    logits = torch.tensor([[-inf, -inf, 0.3, 0.0, 1.1, -inf], [-inf, 0.0, -inf, 2.0, 0.0, -inf]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, u, dtype=torch.float64))
    tokens, _ = Sampler(seed=0)(logits, seqs(2, temperature=1.0))
    assert tokens == ([2, 1] if u == 0 else [4, 4])


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch():
    logits = torch.randn(1, 50).expand(6, -1).contiguous()
    alone = [Sampler(seed=s)(logits[:1], seqs(1, temperature=1.0, seed=7))[0][0] for s in range(20)]
    with_others = [Sampler(seed=s)(logits, seqs(5, temperature=1.0) + seqs(1, temperature=1.0, seed=7))[0][-1]
                   for s in range(20)]
    assert alone == with_others  # the row's own generator, not the sampler's
