"""The DP-SGD step of every private node (lightning_privdec.privacy.dp_step): each example's gradient clipped to C,
summed, plus the node's N(0, sigma^2 C^2 I), divided by qJ; ghost clipping's clipped sum equals the per-sample one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_privdec.privacy import PerSampleGradients, PrivacyConfigError, node_noise_generator, noise_clipped_sum
from lightning_privdec.privacy.dp_step import DPStepStats, clip_and_accumulate
from lightning_privdec.privacy.noise import NoiseGenerator
from tests.test_privacy import MLP, LinearRegression, batch

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]



def privatize_gradients(
    params: list[nn.Parameter], grad_samples: list[torch.Tensor], *, max_grad_norm: float, noise_multiplier: float,
    expected_batch_size: float, generator: NoiseGenerator,
) -> DPStepStats:
    """The library's DP step on given per-sample gradients: clip and sum in float64 (``clip_and_accumulate``, as
    ``PerSampleGradients.clip_and_sum`` does), then the node's noise and the division by q J (``noise_clipped_sum``),
    into ``p.grad``."""
    sums, norms = clip_and_accumulate(grad_samples, max_grad_norm, params[0].device)
    sums = [summed.to(p.device).view_as(p) for p, summed in zip(params, sums)]
    return noise_clipped_sum(params, norms, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                             expected_batch_size=expected_batch_size, generator=generator, clipped_sums=sums)

def fixed_grad_samples(batch_size: int, seed: int = 0) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(40, 25)), nn.Parameter(torch.zeros(1000))]
    samples = [0.01 * torch.randn(batch_size, *p.shape, generator=g) for p in params]
    return params, samples


def flat_grad(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def test_noise_is_added_with_std_sigma_c_over_expected_batch_size() -> None:
    sigma, clip, expected = 1.5, 1.0, 8.0
    params, samples = fixed_grad_samples(6)
    gen = node_noise_generator("cpu", seed=0, rank=0)

    privatize_gradients(params, samples, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=expected,
                        generator=gen)
    clean = flat_grad(params).clone()
    # noise-free: deterministic, and equal to the clipped sum / expected batch size (norms here are < C)
    torch.testing.assert_close(clean, torch.cat([s.sum(0).reshape(-1) for s in samples]) / expected)
    privatize_gradients(params, samples, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=expected,
                        generator=gen)
    assert torch.equal(flat_grad(params), clean)

    draws = []
    for _ in range(20):
        stats = privatize_gradients(params, samples, max_grad_norm=clip, noise_multiplier=sigma,
                                    expected_batch_size=expected, generator=gen)
        draws.append(flat_grad(params) - clean)
    noise = torch.stack(draws)  # 20 draws x 2000 coordinates, over BOTH parameters
    target = sigma * clip / expected
    assert noise.std().item() == pytest.approx(target, rel=0.03)
    assert noise.mean().abs().item() < 4 * target / math.sqrt(noise.numel())
    assert (noise.std(dim=0) > 0).all()  # every coordinate is noised
    assert not torch.allclose(draws[0], draws[1])
    assert stats.batch_size == 6 and stats.noise_std == pytest.approx(sigma * clip)


def test_clipping_bounds_one_examples_influence_on_the_update() -> None:
    clip, lr, expected = 5.0, 0.1, 8.0
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)
    x[3] *= 1e4  # one example with a huge gradient

    def updated(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object]:
        torch.manual_seed(0)
        model = LinearRegression()
        psg = PerSampleGradients(model)
        model.training_step((x[keep], y[keep]), 0).backward()
        stats = privatize_gradients(psg.parameters, psg.per_sample_grads(), max_grad_norm=clip,
                                    noise_multiplier=0.0, expected_batch_size=expected,
                                    generator=node_noise_generator("cpu", 0, 0))
        gradient = flat_grad(psg.parameters).clone()
        torch.optim.SGD(model.parameters(), lr=lr).step()
        psg.detach()
        return gradient, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), stats

    everyone = torch.arange(8)
    g_with, w_with, stats = updated(everyone)
    g_without, w_without, _ = updated(everyone[everyone != 3])
    assert stats.max_norm.item() > 1e4 * clip and 0 < stats.clipped_fraction.item() < 1
    assert (g_with - g_without).norm().item() <= clip / expected * (1 + 1e-4)
    assert (w_with - w_without).norm().item() <= lr * clip / expected * (1 + 1e-4)
    assert (g_with - g_without).norm().item() > 0.5 * clip / expected  # clipped to C, not dropped


def test_an_example_whose_materialised_gradient_is_not_finite_is_never_dropped_silently() -> None:
    """An infinite entry in one example's materialised gradient (non-finite input data, or finite inputs whose
    float32 products overflowed) makes the clipped sum non-finite: the node then stops at its non-finite gradient
    (NodeRunner.check_finite) instead of training on with that example silently left out."""
    grads = [torch.randn(4, 3, 2), torch.randn(4, 5)]
    grads[0][1, 0, 0] = float("inf")
    sums, norms = clip_and_accumulate(grads, 1.0, torch.device("cpu"))
    assert not bool(torch.isfinite(norms[1])) and bool(torch.isfinite(norms[[0, 2, 3]]).all())
    assert not bool(torch.isfinite(sums[0]).all())


def test_flat_clipping_is_joint_over_all_parameters() -> None:
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))]
    samples = [torch.full((1, 3), 3.0), torch.full((1, 4), 4.0)]  # joint norm sqrt(27 + 64) > per-parameter norms
    privatize_gradients(params, samples, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0,
                        generator=node_noise_generator("cpu", 0, 0))
    # C less the rounding bound of a sum of SUM_BLOCK = 256 examples (gamma_256 = 1.5e-5), whatever the batch size
    assert 1.0 - 3e-5 <= flat_grad(params).norm().item() <= 1.0
    torch.testing.assert_close(params[0].grad / params[1].grad[:3], torch.full((3,), 0.75))


def test_empty_batch_releases_pure_noise() -> None:
    sigma, clip, expected = 2.0, 1.0, 10.0
    params = [nn.Parameter(torch.zeros(5000))]
    params[0].grad = torch.full((5000,), float("nan"))  # what a mean loss over an empty batch leaves behind
    stats = privatize_gradients(params, [torch.zeros(0, 5000)], max_grad_norm=clip, noise_multiplier=sigma,
                                expected_batch_size=expected, generator=node_noise_generator("cpu", 1, 0))
    grad = params[0].grad
    assert torch.isfinite(grad).all() and stats.batch_size == 0
    assert grad.std().item() == pytest.approx(sigma * clip / expected, rel=0.05)
    privatize_gradients(params, [torch.zeros(0, 5000)], max_grad_norm=clip, noise_multiplier=0.0,
                        expected_batch_size=expected, generator=node_noise_generator("cpu", 0, 0))
    assert torch.equal(params[0].grad, torch.zeros(5000))


def test_empty_batch_through_a_lightning_module() -> None:
    model = MLP()
    psg = PerSampleGradients(model)
    x, y = batch(0)
    loss = model.training_step((x, y), 0)
    loss.backward()
    assert torch.isnan(loss)
    grads = psg.per_sample_grads()
    assert [g.shape for g in grads] == [(0, *p.shape) for p in psg.parameters]
    privatize_gradients(psg.parameters, grads, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0,
                        generator=node_noise_generator("cpu", 0, 0))
    assert all(torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in psg.parameters)
    psg.clear()
    # a step whose training_step skipped backward altogether also yields empty per-sample gradients
    assert all(g.shape[0] == 0 for g in psg.per_sample_grads())
    psg.detach()


def test_the_noise_step_values_are_refused_where_the_node_sets_them() -> None:
    """C when the node is built, sigma with the privacy parameters, qJ when set (the step itself checks nothing)."""
    from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
    from lightning_privdec.privacy import PrivacyParameters

    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(PrivacyConfigError, match="max_grad_norm"):
            DPCSGPNode(PrivacyParameters(max_grad_norm=bad, noise_multiplier=1.0), rank=0)
    node = DPCSGPNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=-1.0), rank=0)
    node.sample_rate = 0.5
    with pytest.raises(PrivacyConfigError, match="noise_multiplier"):
        node.plan_noise(10)
    for bad in (0, -2.0, float("inf")):
        with pytest.raises(PrivacyConfigError, match="expected_batch_size"):
            node.expected_batch_size = bad


def test_node_noise_generators_are_per_node() -> None:
    def draw(gen: NoiseGenerator) -> torch.Tensor:
        return gen.normal(64, 1.0)

    torch.manual_seed(0)  # seed_everything-style global seeding must not matter
    rank0, rank1 = node_noise_generator("cpu", 7, 0), node_noise_generator("cpu", 7, 1)
    a, b = draw(rank0), draw(rank1)
    assert not torch.allclose(a, b)
    assert torch.equal(a, draw(node_noise_generator("cpu", 7, 0)))  # reproducible per (seed, rank)
    assert not torch.allclose(a, draw(node_noise_generator("cpu", 8, 0)))
    torch.manual_seed(0)
    s1 = draw(node_noise_generator("cpu", None, 0))
    torch.manual_seed(0)
    s2 = draw(node_noise_generator("cpu", None, 0))
    assert not torch.allclose(s1, s2)  # seeded from os.urandom, independent of the global seed
    assert node_noise_generator(torch.device("cpu"), None, 3).device == torch.device("cpu")
    with pytest.raises(PrivacyConfigError, match="rank"):
        node_noise_generator("cpu", 0, -1)


def test_ghost_clipping_gives_the_same_private_gradient_as_per_sample_hooks() -> None:
    """Ghost clipping never materialises per-sample gradients, yet its noisy clipped mean is the same."""
    from lightning_privdec.privacy import GhostClipping

    x, y = batch(10)
    x[3] *= 50.0  # one example far beyond the clipping bound
    reference, ghost_model = MLP(), MLP()
    ghost_model.load_state_dict(reference.state_dict())
    hooks = PerSampleGradients(reference)
    F.cross_entropy(reference(x), y).backward()
    privatize_gradients(
        hooks.parameters, hooks.per_sample_grads(), max_grad_norm=0.5, noise_multiplier=1.0,
        expected_batch_size=8, generator=node_noise_generator("cpu", 3, 0),
    )
    ghost = GhostClipping(ghost_model, max_grad_norm=0.5)
    norms = ghost.backward(F.cross_entropy(ghost_model(x), y, reduction="none"))
    with pytest.raises(ValueError, match="needs clipped_sums=.*take_clipped_sums"):  # p.grad: the rounded sum
        noise_clipped_sum(ghost.parameters, norms, max_grad_norm=0.5, noise_multiplier=1.0, expected_batch_size=8,
                          generator=node_noise_generator("cpu", 3, 0))
    stats = noise_clipped_sum(
        ghost.parameters, norms, max_grad_norm=0.5, noise_multiplier=1.0, expected_batch_size=8,
        generator=node_noise_generator("cpu", 3, 0), clipped_sums=ghost.take_clipped_sums(),
    )
    assert stats.batch_size == 10 and float(stats.max_norm) > 0.5
    for a, b in zip(reference.parameters(), ghost_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(PrivacyConfigError, match="reduction='none'"):
        ghost.backward(F.cross_entropy(ghost_model(x), y))  # a mean loss cannot be ghost-clipped
    empty = ghost.backward(F.cross_entropy(ghost_model(x[:0]), y[:0], reduction="none"))
    assert empty.numel() == 0 and all(torch.count_nonzero(p.grad) == 0 for p in ghost.parameters)
    ghost.detach()


def test_a_released_gradient_a_caller_keeps_is_never_overwritten_by_the_next_step() -> None:
    """The noisy gradients go into host buffers kept across steps (no fresh tensor, and its page faults, per step),
    but only while nothing else holds them: a released ``p.grad`` that user code keeps (``saved = p.grad``, then
    ``zero_grad(set_to_none=True)``) keeps its values, and the buffer is reused once nobody holds it."""
    from lightning_privdec.privacy.local_dp import GaussianMechanism

    p = nn.Parameter(torch.zeros(1000))
    mechanism = GaussianMechanism(rank=0, device="cpu", noise_seed=0)

    def step(value: float) -> None:
        p.grad = None  # Lightning's zero_grad(set_to_none=True)
        mechanism.noise_clipped_sum([p], torch.ones(4), max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0,
                                    clipped_sums=[torch.full((1000,), value, dtype=torch.float64)])

    step(100.0)
    saved = p.grad
    snapshot = saved.clone()
    step(-100.0)
    assert torch.equal(saved, snapshot) and saved.data_ptr() != p.grad.data_ptr()
    first = p.grad.data_ptr()
    step(5.0)  # nobody held the step before's gradient: its buffer is reused
    assert p.grad.data_ptr() == first
