"""DPCSGPNode (DP-CSGP, Algorithm 1, and its PrivSGP and DP^2-SGD baselines) and the private strategies' setup checks,
in one process; on the loopback network against a transcription of Algorithm 1."""

from __future__ import annotations

import threading

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


def dp(seed: int | None = None, **params) -> DPCSGPNode:
    params.setdefault("max_grad_norm", 1.0)
    return DPCSGPNode(PrivacyParameters(**params), rank=1, device=torch.device("cpu"), noise_seed=seed)


def loader(n: int = 100, batch_size: int = 10, world_size: int = 4, rank: int = 1) -> DataLoader:
    dataset = TensorDataset(torch.randn(n, 3), torch.randint(0, 2, (n,)))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def test_each_node_poisson_samples_its_own_shard_at_q_equal_b_over_j():
    e = dp(target_epsilon=3.0, target_delta=1e-5)
    private = e.private_dataloader(loader(n=103), planned_steps=30, world_size=4)
    assert len(private.dataset) == 26  # rank 1's strided shard of 103 examples, without DistributedSampler padding
    assert e.sample_rate == pytest.approx(10 / 26)
    assert len(private) == len(loader(n=103))  # same number of batches per epoch on every node
    assert epsilon_for(e.noise_multiplier, e.sample_rate, 30, 1e-5) == pytest.approx(3.0, rel=0.01)


def test_a_loader_without_a_distributed_sampler_is_refused_unless_the_data_is_node_local():
    plain = DataLoader(TensorDataset(torch.randn(50, 3)), batch_size=5)
    with pytest.raises(PrivacyConfigError, match="node_local_data"):
        dp(noise_multiplier=1.0).private_dataloader(plain, planned_steps=10, world_size=4)
    e = dp(noise_multiplier=1.0)
    e.private_dataloader(plain, planned_steps=10, world_size=4, node_local_data=True)
    assert e.sample_rate == pytest.approx(5 / 50)


def test_node_local_data_is_the_whole_loader_even_when_lightning_adds_a_distributed_sampler():
    """use_distributed_sampler=True (Lightning's default) wraps the node's own data in a DistributedSampler, which
    would give each node only 1/world of it; a sampler that picks the node's examples out of shared data contradicts
    node_local_data and is refused."""
    from lightning_privdec.data.partition import DirichletPartitionSampler

    e = dp(noise_multiplier=1.0)
    private = e.private_dataloader(loader(n=103), planned_steps=10, world_size=4, node_local_data=True)
    assert len(private.dataset) == 103 and e.sample_rate == pytest.approx(10 / 103)
    dataset = TensorDataset(torch.randn(40, 3), torch.arange(40) % 2)
    partition = DirichletPartitionSampler(torch.arange(40) % 2, alpha=1.0, num_replicas=2, rank=1, seed=0)
    with pytest.raises(PrivacyConfigError, match="node_local_data=False"):
        dp(noise_multiplier=1.0).private_dataloader(DataLoader(dataset, batch_size=4, sampler=partition),
                                                        planned_steps=10, world_size=2, node_local_data=True)


def test_batch_size_larger_than_the_shard_is_refused():
    with pytest.raises(PrivacyConfigError, match="shard"):
        dp(noise_multiplier=1.0).private_dataloader(loader(n=20, batch_size=10), planned_steps=5, world_size=4)


def attached_node(**params) -> tuple[DPCSGPNode, nn.Module]:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    e = dp(**params)
    e.attach(model)
    return e, model


def one_step(e: DPCSGPNode, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()
    private_step(e)


def test_secure_nodes_never_put_their_generators_in_a_checkpoint():
    secure, _ = attached_node(noise_multiplier=1.0)
    assert "noise_generator" not in secure.state_dict() and "sampling_generator" not in secure.state_dict()
    seeded, _ = attached_node(noise_multiplier=1.0, seed=3)
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
    e = dp(noise_multiplier=1.5, target_epsilon=2.0, target_delta=1e-5, accountant=accountant)
    e.private_dataloader(loader(n=400, batch_size=10), planned_steps=1000)  # q = 0.1: about 20 steps fit
    q, sigma = e.sample_rate, e.noise_multiplier
    for step in range(200):
        exact = e.ledger.epsilon_after(1, GaussianRelease(sigma, q)) > 2.0
        assert e.next_step_exceeds_budget() == exact, step
        if exact:
            break
        e.ledger.record(GaussianRelease(sigma, q))
    assert exact and 10 < step < 200  # the boundary was crossed inside the loop
    assert e.epsilon() <= 2.0
    # a checkpointed ledger with fewer steps and another sigma: the count starts over
    saved = e.state_dict()
    fresh = dp(noise_multiplier=1.5, target_epsilon=2.0, target_delta=1e-5, accountant=accountant)
    fresh.private_dataloader(loader(n=400, batch_size=10), planned_steps=1000)
    assert not fresh.next_step_exceeds_budget()
    fresh.load_state_dict(saved)
    assert fresh.next_step_exceeds_budget()
    fresh.noise_multiplier = 20.0  # far more noise per step: more steps fit again
    assert fresh.ledger.epsilon_after(1, GaussianRelease(20.0, q)) <= 2.0
    assert not fresh.next_step_exceeds_budget()


def test_the_private_step_and_compressed_push_sum_follow_a_transcription_of_algorithm_1_on_several_nodes():
    """Three DP-CSGP nodes on the loopback network (the simulator runs the strategies' node step) against a float64
    transcription on the batches they drew: lines 8-10 (each example's gradient at z_i clipped to C, summed, plus the
    node's own N(0, sigma^2 C^2 I), over qJ), line 11 (SGD on the numerator x), lines 1-7 (TopK of x - x_hat, the
    public copies, line 5 at gamma = 1, y = A y, z = x / y) on a directed ring; and each node's ledger."""
    import networkx as nx

    from lightning_privdec.algorithms.simulation import train_network
    from lightning_privdec.compression import TopK
    from lightning_privdec.privacy.noise import node_noise_generator
    from lightning_privdec.topology import build_topology

    n, J, B, C, sigma, lr, steps, seed = 3, 12, 4, 0.8, 0.7, 0.4, 6, 5
    topology = build_topology(nx.cycle_graph(n, create_using=nx.DiGraph), n, weights="push-sum")
    compressor = TopK(0.5)
    generator = torch.Generator().manual_seed(1)
    datasets = [TensorDataset(torch.randn(J, 4, generator=generator), torch.randint(0, 3, (J,), generator=generator))
                for _ in range(n)]
    seen: list[list[tuple]] = [[] for _ in range(n)]  # per node and step: (z, x, y) of the step's forward, or None
    released: list[list[torch.Tensor]] = [[] for _ in range(n)]

    thread = threading.local()  # each simulated node runs in its own thread

    class Recorded(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            thread.forward = (torch.cat([self.weight.detach().reshape(-1), self.bias.detach()]).clone(), x.clone())
            return super().forward(x)

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return Recorded(4, 3)

    def loss(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        thread.step = (*thread.forward, y.clone())
        return F.cross_entropy(output, y)

    def after_step(taken: int, run) -> None:  # noqa: ANN001
        seen[run.node.rank].append(thread.__dict__.pop("step", None))
        released[run.node.rank].append(torch.cat([p.grad.reshape(-1) for p in run.model.parameters()]).clone())

    def make_node(rank: int) -> DPCSGPNode:
        return DPCSGPNode(PrivacyParameters(max_grad_norm=C, noise_multiplier=sigma), rank=rank,
                          device=torch.device("cpu"), noise_seed=seed)

    runs = train_network(make_node, make_model, datasets, topology=topology, batch_size=B, steps=steps, lr=lr,
                         loss=loss, compressor=compressor, consensus_step=1.0, seed=seed, after_step=after_step)

    # the transcription, in float64 with the dense mixing matrix
    x0 = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()]).double()
    d, k = x0.numel(), compressor.num_kept(x0.numel())
    A = torch.as_tensor(topology.mixing_matrix(0), dtype=torch.float64)
    x, y, copies = [x0.clone() for _ in range(n)], [1.0] * n, [x0.clone() for _ in range(n)]
    noise = [node_noise_generator("cpu", seed, rank) for rank in range(n)]
    q = runs[0].node.sample_rate
    assert q == B / J and all(run.node.expected_batch_size == B for run in runs)

    def clipped_gradient(z: torch.Tensor, features: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        w = z.clone().requires_grad_(True)
        logits = features.double() @ w[:12].reshape(3, 4).T + w[12:]
        (gradient,) = torch.autograd.grad(F.cross_entropy(logits[None], label[None]), w)
        return gradient * min(1.0, C / float(gradient.norm()))

    sampled = 0
    for t in range(steps):
        x_half = []
        for i in range(n):
            z = x[i] / y[i]
            total = torch.zeros(d, dtype=torch.float64)
            if seen[i][t] is not None:  # an empty Poisson batch releases the noise alone
                z_seen, features, labels = seen[i][t]
                assert torch.allclose(z_seen.double(), z, atol=1e-5), (t, i)
                total = sum((clipped_gradient(z, f, label) for f, label in zip(features, labels)), total)
                sampled += len(labels)
            g = (total + noise[i].normal(d, sigma * C, torch.float32).double()) / (q * J)  # lines 8-10
            assert torch.allclose(released[i][t].double(), g, atol=1e-5), (t, i)
            x_half.append(x[i] - lr * g)  # line 11
        for i in range(n):  # lines 1, 4: q_i = TopK(x_i - x_hat_i), x_hat_i += q_i (one copy per sender: static graph)
            difference = x_half[i] - copies[i]
            kept = difference.abs().topk(k).indices
            copies[i][kept] += difference[kept]
        for i in range(n):  # line 5 at gamma = 1, line 6
            x[i] = x_half[i] + sum(A[i, j] * copies[j] for j in range(n) if j != i) - (1 - A[i, i]) * copies[i]
        y = [float(sum(A[i, j] * y[j] for j in range(n))) for i in range(n)]
    for i, run in enumerate(runs):
        torch.testing.assert_close(run.parameters.double(), x[i] / y[i], atol=1e-5, rtol=0)
        assert run.node.ledger.steps == steps
        assert run.node.ledger.epsilon(1e-5) == epsilon_for(sigma, q, steps, 1e-5)
    assert sampled > 0
