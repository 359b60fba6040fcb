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


def test_norm_upper_bound_of_underflowing_entries_is_not_zero() -> None:
    x = torch.full((3, 50), 1e-30, dtype=torch.float32)  # squares underflow float32
    exact = torch.linalg.vector_norm(x.double(), dim=1)
    assert bool((norm_upper_bound(x, dim=1) >= exact).all())
