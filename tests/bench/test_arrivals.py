"""Arrival processes: mean rate and coefficient of variation with a fixed seed."""
import numpy as np
import pytest

from inferd.bench.arrivals import LoadShape, arrival_offsets_s, arrival_offsets_within_s
from inferd.bench.errors import BenchError

N = 40_000


def gaps(shape: LoadShape) -> np.ndarray:
    return np.diff(arrival_offsets_s(shape, N, seed=7))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_mean_rate_and_cv(burstiness):
    g = gaps(LoadShape("gamma", rate_per_s=8.0, burstiness=burstiness))
    assert 1 / g.mean() == pytest.approx(8.0, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.03)


def test_poisson_is_gamma_of_shape_one_whatever_the_burstiness():
    g = gaps(LoadShape("poisson", rate_per_s=2.0, burstiness=9.0))
    assert 1 / g.mean() == pytest.approx(2.0, rel=0.03) and g.std() / g.mean() == pytest.approx(1.0, rel=0.03)


def test_constant_rate_and_first_arrival_at_zero():
    offsets = arrival_offsets_s(LoadShape("constant", rate_per_s=4.0), 5, seed=0)
    assert offsets == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_arrivals_within_duration():
    offsets = arrival_offsets_within_s(LoadShape("poisson", rate_per_s=50.0), 20.0, seed=3)
    assert offsets[0] == 0.0 and max(offsets) < 20.0 and offsets == sorted(offsets)
    assert len(offsets) == pytest.approx(1000, rel=0.1)
    assert len(arrival_offsets_within_s(LoadShape("constant", rate_per_s=2.0), 3.0, seed=0)) == 6


def test_seed_reproducible():
    shape = LoadShape("gamma", rate_per_s=3.0, burstiness=0.5)
    assert arrival_offsets_s(shape, 50, seed=1) == arrival_offsets_s(shape, 50, seed=1)
    assert arrival_offsets_s(shape, 50, seed=1) != arrival_offsets_s(shape, 50, seed=2)


def test_bad_shapes_are_refused():
    with pytest.raises(BenchError, match="--rate must be positive"):
        LoadShape("poisson", rate_per_s=0.0)
    with pytest.raises(BenchError, match="--burstiness"):
        LoadShape("gamma", burstiness=0.0)
    with pytest.raises(BenchError, match="--concurrency"):
        LoadShape("closed", concurrency=0)
