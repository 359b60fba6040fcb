"""The divergence guard's bookkeeping (one process); the multi-process stop is in test_divergence_multiprocess.py."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_privdec.strategies.divergence import CONSENSUS, LOSS, DivergenceGuard


def run(guard: DivergenceGuard, losses, corrections, norm: float = 5.0):
    """Feed the checks in order; return (index of the first check that fired, its verdict) or (None, None)."""
    for i, (loss, correction) in enumerate(zip(losses, corrections)):
        verdict = guard.observe(loss, correction, norm)
        if verdict.code:
            return i, verdict
    return None, None


def test_healthy_runs_never_fire():
    g = torch.Generator().manual_seed(0)
    checks = 2000
    noise = torch.rand(checks, generator=g).tolist()
    # a loss that falls with noisy spikes; a correction that builds up 20x after the first check, then wobbles
    losses = [2.3 * math.exp(-i / 300) + 10 * n for i, n in enumerate(noise)]
    corrections = [0.001 * min(20.0, 1 + i) * (1 + n) for i, n in enumerate(noise)]
    assert run(DivergenceGuard(), losses, corrections) == (None, None)
    # tiny early values are floored: a loss starting at 1e-6 and a correction at 1e-9 may grow a lot
    assert run(DivergenceGuard(), [1e-6] + [5.0] * 100, [1e-9] + [1e-3] * 100) == (None, None)
    # a loss that falls below zero (a density's negative log-likelihood) is improving, not diverging
    assert run(DivergenceGuard(), [-0.5 * 2**i for i in range(40)], [0.01] * 40) == (None, None)
    # a private step's empty Poisson batch has no loss (None): skipped
    assert run(DivergenceGuard(), [None] * 100, [0.01] * 100) == (None, None)


def test_geometric_growth_of_the_correction_fires_after_patience_checks():
    corrections = [0.4 * 4.5**i for i in range(20)]  # unstable error feedback: x4.5 every 10 steps
    index, verdict = run(DivergenceGuard(), [2.0] * 20, corrections)
    first_above = next(i for i, c in enumerate(corrections) if c > 1e3 * corrections[0])
    assert verdict.code == CONSENSUS and index == first_above + 2  # three checks in a row
    assert verdict.ratio > 1e3


def test_a_loss_that_grows_without_bound_fires():
    index, verdict = run(DivergenceGuard(), [2.3 * 4**i for i in range(10)], [0.1] * 10)
    assert verdict.code == LOSS and index == 4  # above 23 at checks 2, 3 and 4


def test_a_short_spike_does_not_fire():
    losses = [2.0, 2.0, 50.0, 50.0, 1.0, 50.0, 50.0, 1.0] * 10
    assert run(DivergenceGuard(), losses, [0.1] * len(losses)) == (None, None)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_correction_fires_at_once(bad):
    index, verdict = run(DivergenceGuard(), [2.0, 2.0], [bad, 0.1])
    assert index == 0 and verdict.code == CONSENSUS and math.isinf(verdict.ratio)


def test_the_message_names_the_cause():
    guard = DivergenceGuard()
    _, verdict = run(guard, [2.0] * 10, [0.4 * 10**i for i in range(10)])
    message = guard.message(2, 130, verdict, "Likely cause: consensus_step=1 is too large.")
    assert "node 2" in message and "step 130" in message and "consensus_step=1" in message


def test_checks_are_every_n_steps():
    guard = DivergenceGuard(every_n_steps=10)
    assert [r for r in range(1, 41) if guard.due(r)] == [10, 20, 30, 40]
    with pytest.raises(ValueError):
        DivergenceGuard(loss_factor=1.0)
