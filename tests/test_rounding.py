"""privacy/rounding.py: the norms that set clip factors are never below the true norm."""

from __future__ import annotations

import pytest
import torch

from lightning_privdec.privacy.rounding import NORM_BLOCK, norm_upper_bound


@pytest.mark.parametrize("shape, dim", [
    ((7, 64, 5, 9), 1),  # a strided middle dimension, one block (no copy)
    ((7, 64, 5, 9), (1, 3)),
    ((3, 2 * NORM_BLOCK + 17), 1),  # several blocks and a remainder
    ((4, 3, 33, 40), (1, 2, 3)),
    ((6, 10), None),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_norm_upper_bound_is_above_the_exact_norm_and_tight(shape, dim, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # entries of widely different sizes, so that float32 sums round
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-6, 6, shape, generator=gen))
    x = x.to(dtype)
    exact = torch.linalg.vector_norm(x.double(), dim=dim)
    bound = norm_upper_bound(x, dim=dim)
    assert bound.dtype == torch.float64 and bound.shape == exact.shape
    assert bool((bound >= exact).all())
    assert bool((bound <= exact * (1 + 1e-3) + 1e-30).all())


@pytest.mark.parametrize("shape", [(3, 50), (3, 50, 2)])  # the last dimension reduced, or an outer one only
def test_norm_upper_bound_of_underflowing_entries_is_not_zero(shape) -> None:
    x = torch.full(shape, 1e-30, dtype=torch.float32)  # squares underflow float32
    exact = torch.linalg.vector_norm(x.double(), dim=1)
    assert bool((norm_upper_bound(x, dim=1) >= exact).all())


def test_clip_factors_of_materialised_gradients_do_not_depend_on_the_batch_size() -> None:
    """An example's norm bound (hence its clip factor) is the same in a batch of 3 and one of 600: removing an
    example moves no other example's factor (aligned clipped examples would otherwise add up that move)."""
    from lightning_privdec.privacy.dp_step import clip_and_accumulate

    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(600, 40, generator=gen) * 5
    _, small = clip_and_accumulate([rows[:3]], 1.0, torch.device("cpu"))
    _, large = clip_and_accumulate([rows], 1.0, torch.device("cpu"))
    assert torch.equal(small, large[:3])


def test_weighted_row_sum_is_the_blockwise_sum_within_its_bound() -> None:
    from lightning_privdec.privacy.rounding import SUM_BLOCK, sum_rounding, weighted_row_sum

    gen = torch.Generator().manual_seed(2)
    rows, weights = torch.randn(3 * SUM_BLOCK + 5, 7, generator=gen), torch.rand(3 * SUM_BLOCK + 5, generator=gen)
    exact = (weights.double()[:, None] * rows.double()).sum(0)
    error = (weighted_row_sum(weights, rows).double() - exact).abs()
    mass = (weights.double()[:, None] * rows.double()).abs().sum(0)
    assert bool((error <= sum_rounding(SUM_BLOCK, torch.float32) * mass + 1e-6 * exact.abs()).all())


def test_the_norm_of_one_entry_is_its_magnitude_exactly() -> None:
    """A reduction over one entry (a depthwise convolution's output per group) is |x| itself in float64: exact, so
    an upper bound with nothing added; NaN and infinities pass through, a denormal is kept."""
    x = torch.tensor([1.5, -0.0, float("nan"), float("-inf"), 1e-45, -3.25]).view(6, 1, 1)
    bound = norm_upper_bound(x, dim=(1, 2))
    assert bound.dtype == torch.float64 and bound.shape == (6,)
    assert bound[[0, 1, 3, 4, 5]].tolist() == [1.5, 0.0, float("inf"), float(torch.tensor(1e-45)), 3.25]
    assert bool(torch.isnan(bound[2]))
    rows = torch.randn(4, 1, 7, dtype=torch.bfloat16)
    assert torch.equal(norm_upper_bound(rows, dim=1), rows.abs().double().squeeze(1))
