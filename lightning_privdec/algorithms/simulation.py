"""Run a paper's node algorithm without Lightning: n simulated nodes on the loopback network, one thread each.

Each step is the node step the strategies run (:class:`~.node.NodeRunner`: forward and backward at the node's
model, the release privatized, recorded and checked, the optimizer on the numerator x, the gossip round and the
de-biased model), with plain SGD instead of the Trainer. The papers' toy experiments (``examples/toy_*.py``) and the
privacy audit use it::

    runs = train_network(make_node, make_model, datasets, topology=topology, batch_size=32, steps=100, lr=0.1,
                         loss=loss_fn)
    print(consensus_distance(runs), [run.node.epsilon() for run in runs])
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_privdec.algorithms.base import Gossip, PrivateNodeAlgorithm
from lightning_privdec.algorithms.flat_parameters import FlatParameters
from lightning_privdec.algorithms.node import NodeRunner
from lightning_privdec.comm import Exchange, LoopbackNetwork
from lightning_privdec.compression import Compressor
from lightning_privdec.topology import Topology


@dataclass
class NodeRun:
    """What one simulated node ends with (``sent``: what its exchange recorded, when it records messages)."""

    node: PrivateNodeAlgorithm
    model: nn.Module
    gossip: Gossip
    losses: list[float] = field(default_factory=list)  # the mean training loss of every non-empty batch

    @property
    def parameters(self) -> Tensor:
        """The node's final (de-biased) parameters, flat."""
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters() if p.requires_grad])


def train_node(
    node: PrivateNodeAlgorithm,
    model: nn.Module,
    dataset: Dataset,
    *,
    exchange: Exchange,
    topology: Topology,
    batch_size: int,
    steps: int,
    lr: float,
    loss: Callable[..., Tensor],
    compressor: Compressor | None = None,
    push_sum_weight: bool = True,
    consensus_step: float | str = "auto",
    seed: int = 0,
    after_step: Callable[[int, NodeRun], None] | None = None,
    agree: Callable[[bool], bool] = bool,
) -> NodeRun:
    """``steps`` private steps of one node (plain SGD at ``lr``) on Poisson batches of its ``dataset``.

    ``loss(model(x), *rest)`` gives per-example or mean losses of a batch ``(x, *rest)`` (per-example losses for a
    node in ghost-clipping mode); ``after_step(t, run)`` sees the node after every step. Before the first step the
    node's per-example probe runs (:meth:`~lightning_privdec.algorithms.base.PrivateNodeAlgorithm.check_examples`).
    Every node must start from the same parameters (build ``model`` under a fixed seed). After each step the node
    stops early when ``agree(one more step would exceed this node's target_epsilon)`` says so: it must give every node
    the same answer (:func:`train_network` passes "any node's"; the default, the node's own, suits nodes with one plan).
    """
    node.attach(model)
    flat = FlatParameters(model)
    gossip = node.build_gossip(
        flat.buffer, rank=exchange.rank, topology=topology, exchange=exchange, compressor=compressor,
        push_sum_weight=push_sum_weight, seed=seed, consensus_step=consensus_step, staleness=0,
    )
    optimizer = torch.optim.SGD(flat.parameters, lr=lr)
    node.configure_optimizer(optimizer, flat.numel)
    loader = node.private_dataloader(DataLoader(dataset, batch_size=batch_size), steps, exchange.world_size,
                                     node_local_data=True)
    run = NodeRun(node, model, gossip)
    runner = NodeRunner(model, flat, gossip, node, rank=exchange.rank)
    runner.check_plan(shard_size=len(loader.dataset))  # type: ignore[arg-type]  (as the strategies do)

    def backward(batch: Sequence[Tensor], probe: bool = False) -> bool:
        x, *rest = batch
        if len(x) == 0:
            return False  # an empty Poisson batch releases pure noise
        value = loss(model(x), *rest)
        if node.clipping.ghost is not None:  # ghost clipping: per-example losses, clipped in their own backward
            node.clipping.ghost.check_loss_shape(value)
            if probe:
                node.clipping.ghost.loss_sum(value, node.expected_micro_batch_size).backward()
            else:
                node.clipping.ghost_backward(value, node.expected_micro_batch_size)
        else:  # the mean loss, times the run's power-of-two multiplier (as the strategies' precision helper does)
            multiplier = node.clipping.mean_loss_multiplier(node.expected_micro_batch_size)
            ((value.mean() if value.dim() > 0 else value) * multiplier).backward()
        if not probe:
            run.losses.append(float(value.detach().mean()))
        return True

    node.check_examples(lambda batch: backward(batch, probe=True))  # per-sample gradients are per example
    node.before_first_step(backward)
    taken = 0
    while taken < steps:
        for batch in loader:
            if taken == steps:
                break
            optimizer.zero_grad(set_to_none=True)
            runner.step(optimizer, partial(backward, batch), step=taken)  # the strategies' step (algorithms/node.py)
            taken += 1
            if after_step is not None:
                after_step(taken, run)
            if taken < steps and agree(runner.next_step_exceeds_budget()):
                return run  # one more step would take some node past its target: every node stops here
    return run


def train_network(
    make_node: Callable[[int], PrivateNodeAlgorithm],
    make_model: Callable[[], nn.Module],
    datasets: Sequence[Dataset],
    **options: Any,
) -> list[NodeRun]:
    """:func:`train_node` for every node of a loopback network of ``len(datasets)`` nodes (one thread each, one
    intra-op thread: tiny tensors). ``make_model`` must give every node the same starting parameters; the nodes and
    models are made one after the other in the caller's thread (a ``make_model`` that seeds torch's global generator
    would race with itself across the nodes' threads)."""
    nodes = [make_node(rank) for rank in range(len(datasets))]
    models = [make_model() for _ in datasets]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        network = LoopbackNetwork(len(datasets), timeout=600.0)
        agree = any_node(len(datasets))
        return network.run(
            lambda rank, exchange: train_node(nodes[rank], models[rank], datasets[rank], exchange=exchange,
                                              agree=lambda vote: agree(rank, vote), **options)
        )
    finally:
        torch.set_num_threads(threads)


def any_node(world_size: int, timeout: float = 600.0) -> Callable[[int, bool], bool]:
    """``agree(rank, vote)``, called by every node's thread at the same point: whether any node voted True (the
    one-bit all-reduce of the strategies' budget stop, between threads). A node that never comes (its thread
    failed) breaks the wait after ``timeout`` seconds, as a missing message does on the loopback network."""
    votes = [False] * world_size
    barrier = threading.Barrier(world_size, timeout=timeout)

    def agree(rank: int, vote: bool) -> bool:
        votes[rank] = vote
        barrier.wait()
        decision = any(votes)
        barrier.wait()  # every node has read the votes before the next round overwrites them
        return decision

    return agree


def consensus_distance(runs: Sequence[NodeRun]) -> float:
    """max_i ||x_i - x_bar||: how far the farthest node's model is from the network average."""
    models = torch.stack([run.parameters for run in runs])
    return float((models - models.mean(0)).norm(dim=1).max())
