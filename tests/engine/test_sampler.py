import pytest
import torch

from inferd.engine.request import SamplingParams
from inferd.engine.sampler import Sampler
from inferd.engine.sequence import Sequence
from inferd.models.cpu_kernels import TorchKernels
from inferd.kernels.variants import load_kernels

# the draw in torch and as the C++ op (skipped where it cannot be built)
KERNELS = [pytest.param(TorchKernels, id="torch"),
           pytest.param("cpp", id="cpp", marks=pytest.mark.skipif(load_kernels() is None, reason="no C++ ops"))]


def kernels(which):
    return load_kernels() if which == "cpp" else which


def seqs(n: int, **params) -> list[Sequence]:
    return [Sequence(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=4, **params)) for i in range(n)]


@pytest.mark.parametrize("which", KERNELS)
def test_sampled_tokens_follow_the_distribution_and_never_take_a_masked_token(which):
    p = torch.tensor([0.0, 0.1, 0.6, 0.0, 0.3, 0.0])  # zeros at both ends and inside: masked (-inf) logits
    logits = p.log().expand(4000, -1).contiguous()
    sampler = Sampler(seed=0, kernels=kernels(which))
    tokens, _ = sampler(logits, seqs(4000, temperature=1.0))
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float()
    assert counts[[0, 3, 5]].sum() == 0
    assert torch.allclose(counts / counts.sum(), p, atol=0.025), counts / counts.sum()


@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("u", [0.0, 1 - 2 ** -53])  # the ends of torch.rand's [0, 1)
def test_draws_at_the_ends_of_the_unit_interval_take_tokens_with_probability(monkeypatch, u, which):
    inf = float("inf")
    logits = torch.tensor([[-inf, -inf, 0.3, 0.0, 1.1, -inf], [-inf, 0.0, -inf, 2.0, 0.0, -inf]])
    # and a row longer than the C++ op's vectors and chunks: its tokens of weight at 17 and 40 of 45
    long_row = torch.full((1, 45), -inf)
    long_row[0, [17, 40]] = torch.tensor([0.5, 0.1])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, u, dtype=torch.float64))
    sampler = Sampler(seed=0, kernels=kernels(which))
    tokens, _ = sampler(logits, seqs(2, temperature=1.0))
    assert tokens == ([2, 1] if u == 0 else [4, 4])
    assert sampler(long_row, seqs(1, temperature=0.5))[0] == ([17] if u == 0 else [40])


def test_the_cpp_draw_takes_the_tokens_the_torch_draw_takes():
    ops = load_kernels()
    if ops is None:
        pytest.skip("no C++ ops")
    gen = torch.Generator().manual_seed(0)
    for vocab, temperature in ((64, 0.7), (1000, 1.3)):  # 1,000: not a multiple of the vectors or the chunks
        logits = torch.randn(200, vocab, generator=gen) * 3
        logits[:, torch.randperm(vocab, generator=gen)[:vocab // 3]] = float("-inf")
        t = torch.full((200,), temperature)
        u = torch.rand(200, generator=gen, dtype=torch.float64)
        # rounding (a polynomial exp, weights not normalized) may move a boundary by ~1e-6: few u lie that close
        agree = (ops.sample_rows(logits, t, u) == TorchKernels.sample_rows(logits, t, u)).float().mean()
        assert agree >= 0.99, agree


@pytest.mark.parametrize("which", KERNELS)
def test_greedy_rows_take_the_first_maximum_beside_sampled_rows(which):
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]] * 3)
    sampler = Sampler(seed=0, kernels=kernels(which))
    tokens, _ = sampler(logits, seqs(1, temperature=0.0) + seqs(1, temperature=1.0) + seqs(1, temperature=0.0))
    assert tokens[0] == tokens[2] == 1



@pytest.mark.parametrize("which", KERNELS)
def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch(which):
    logits = torch.randn(1, 50).expand(6, -1).contiguous()
    ops = kernels(which)
    alone = [Sampler(seed=s, kernels=ops)(logits[:1], seqs(1, temperature=1.0, seed=7))[0][0] for s in range(20)]
    with_others = [Sampler(seed=s, kernels=ops)(logits, seqs(5, temperature=1.0) + seqs(1, temperature=1.0, seed=7))[0][-1]
                   for s in range(20)]
    assert alone == with_others  # the row's own generator, not the sampler's
