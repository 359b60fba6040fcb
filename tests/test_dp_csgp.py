"""DPCSGPNode and the private strategies' setup checks, in one process."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_privdec.algorithms.node import private_step
from lightning_privdec.privacy.accounting import GaussianRelease
from lightning_privdec import DPCSGPStrategy, PrivacyConfigError
from lightning_privdec.privacy import PrivacyParameters, epsilon_for


from lightning_privdec.algorithms.dp_csgp import DPCSGPNode


def engine(seed: int | None = None, **params) -> DPCSGPNode:
    params.setdefault("max_grad_norm", 1.0)
    return DPCSGPNode(PrivacyParameters(**params), rank=1, device=torch.device("cpu"), noise_seed=seed)


def loader(n: int = 100, batch_size: int = 10, world_size: int = 4, rank: int = 1) -> DataLoader:
    dataset = TensorDataset(torch.randn(n, 3), torch.randint(0, 2, (n,)))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def test_each_node_poisson_samples_its_own_shard_at_q_equal_b_over_j():
    e = engine(target_epsilon=3.0, target_delta=1e-5)
    private = e.private_dataloader(loader(n=103), planned_steps=30, world_size=4)
    assert len(private.dataset) == 26  # rank 1's strided shard of 103 examples, without DistributedSampler padding
    assert e.sample_rate == pytest.approx(10 / 26)
    assert len(private) == len(loader(n=103))  # same number of batches per epoch on every node
    assert epsilon_for(e.noise_multiplier, e.sample_rate, 30, 1e-5) == pytest.approx(3.0, rel=0.01)


def test_a_loader_without_a_distributed_sampler_is_refused_unless_the_data_is_node_local():
    plain = DataLoader(TensorDataset(torch.randn(50, 3)), batch_size=5)
    with pytest.raises(PrivacyConfigError, match="node_local_data"):
        engine(noise_multiplier=1.0).private_dataloader(plain, planned_steps=10, world_size=4)
    e = engine(noise_multiplier=1.0)
    e.private_dataloader(plain, planned_steps=10, world_size=4, node_local_data=True)
    assert e.sample_rate == pytest.approx(5 / 50)


def test_batch_size_larger_than_the_shard_is_refused():
    with pytest.raises(PrivacyConfigError, match="shard"):
        engine(noise_multiplier=1.0).private_dataloader(loader(n=20, batch_size=10), planned_steps=5, world_size=4)


def attached_engine(**params) -> tuple[DPCSGPNode, nn.Module]:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    e = engine(**params)
    e.attach(model)
    return e, model


def one_step(e: DPCSGPNode, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()
    private_step(e)


def test_resume_continues_the_ledger_keeps_sigma_and_never_rolls_back():
    e, model = attached_engine(target_epsilon=2.0, target_delta=1e-5, seed=5)
    e.private_dataloader(loader(), planned_steps=20, world_size=4)
    sigma = e.noise_multiplier
    for _ in range(3):
        one_step(e, model, torch.randn(4, 3), torch.randint(0, 2, (4,)))
    buffer = io.BytesIO()
    torch.save(e.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed, _ = attached_engine(target_epsilon=2.0, target_delta=1e-5, seed=5)
    resumed.load_state_dict(saved)
    resumed.private_dataloader(loader(), planned_steps=20, world_size=4)
    assert resumed.ledger.steps == 3 and resumed.noise_multiplier == sigma  # same plan: same sigma
    assert resumed.epsilon() == pytest.approx(e.epsilon())

    longer, _ = attached_engine(target_epsilon=2.0, target_delta=1e-5, seed=5)
    longer.load_state_dict(saved)
    longer.private_dataloader(loader(), planned_steps=40, world_size=4)  # a longer plan: more noise per step
    assert longer.noise_multiplier > sigma
    assert longer.ledger.epsilon_if(longer.noise_multiplier, longer.sample_rate, 37) <= 2.0

    for _ in range(2):
        one_step(e, model, torch.randn(4, 3), torch.randint(0, 2, (4,)))
    with pytest.raises(PrivacyConfigError, match="forget spent privacy"):
        e.load_state_dict(saved)  # 3 < 5 steps already spent


def test_secure_engines_never_put_their_generators_in_a_checkpoint():
    secure, _ = attached_engine(noise_multiplier=1.0)
    assert "noise_generator" not in secure.state_dict() and "sampling_generator" not in secure.state_dict()
    seeded, _ = attached_engine(noise_multiplier=1.0, seed=3)
    assert "noise_generator" in seeded.state_dict()  # tests only: the seed is known anyway


def test_private_strategy_arguments_are_checked_when_it_is_built():
    with pytest.raises(PrivacyConfigError, match="max_grad_norm"):
        DPCSGPStrategy(max_grad_norm=0.0, noise_multiplier=1.0)
    with pytest.raises(PrivacyConfigError, match="no privacy level"):
        DPCSGPStrategy(max_grad_norm=1.0)
    with pytest.raises(PrivacyConfigError, match="target_delta"):
        DPCSGPStrategy(max_grad_norm=1.0, target_epsilon=3.0)
    with pytest.raises(PrivacyConfigError, match="target_epsilon"):
        DPCSGPStrategy(max_grad_norm=1.0, target_epsilon=-1.0, target_delta=1e-5)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_budget_check_counts_steps_but_agrees_with_the_accountant_at_every_step(accountant):
    # a fixed sigma with a target: the budget runs out after some tens of steps
    e = engine(noise_multiplier=1.5, target_epsilon=2.0, target_delta=1e-5, accountant=accountant)
    e.private_dataloader(loader(n=400, batch_size=10), planned_steps=1000)  # q = 0.1: about 20 steps fit
    q, sigma = e.sample_rate, e.noise_multiplier
    for step in range(200):
        exact = e.ledger.epsilon_if(sigma, q) > 2.0
        assert e.next_step_exceeds_budget() == exact, step
        if exact:
            break
        e.ledger.record(GaussianRelease(sigma, q))
    assert exact and 10 < step < 200  # the boundary was crossed inside the loop
    assert e.epsilon() <= 2.0
    # a checkpointed ledger with fewer steps and another sigma: the count starts over
    saved = e.state_dict()
    fresh = engine(noise_multiplier=1.5, target_epsilon=2.0, target_delta=1e-5, accountant=accountant)
    fresh.private_dataloader(loader(n=400, batch_size=10), planned_steps=1000)
    assert not fresh.next_step_exceeds_budget()
    fresh.load_state_dict(saved)
    assert fresh.next_step_exceeds_budget()
    fresh.noise_multiplier = 20.0  # far more noise per step: more steps fit again
    assert fresh.ledger.epsilon_if(20.0, q) <= 2.0
    assert not fresh.next_step_exceeds_budget()
