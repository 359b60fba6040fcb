"""The Laplace mechanism (CPGT's noise, :func:`lightning_privdec.algorithms.cpgt.laplace_noise`): draws from the
node's ChaCha20 stream with the requested scale and the Laplace distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from lightning_privdec.algorithms.cpgt import NOISE_STREAM, laplace_noise
from lightning_privdec.privacy.noise import node_noise_generator


def test_laplace_noise_has_the_requested_scale():
    g = node_noise_generator("cpu", 0, 0, stream=NOISE_STREAM)
    draws = laplace_noise(200_000, 2.0, g)
    assert draws.abs().mean().item() == pytest.approx(2.0, rel=0.02)  # E|x| = theta for Lap(theta)
    assert draws.median().abs().item() < 0.05


def test_laplace_noise_has_its_distribution(device: torch.device) -> None:
    generator = node_noise_generator(device, None, 0)
    scale = 1.5
    draws = laplace_noise(300_000, scale, generator).cpu().numpy()
    assert stats.kstest(draws, "laplace", args=(0, scale)).pvalue > 1e-4
    assert np.mean(np.abs(draws)) == pytest.approx(scale, rel=0.01)
