"""A private strategy's node without Lightning: the node algorithm and the gossip options a strategy object would use
on node ``rank`` of ``world_size``, trained on the loopback network (the privacy audit, the loopback scaling study).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.algorithms.simulation import NodeRun, train_node
from lightning_privdec.comm import Exchange
from lightning_privdec.strategies import PRIVATE_STRATEGIES
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy


def offline_strategy(name: str, rank: int, world_size: int, **kwargs: Any) -> PrivateDecentralizedStrategy:
    """The strategy ``name`` (a key of ``PRIVATE_STRATEGIES``) as node ``rank`` sees it, its graph built."""
    environment = LightningEnvironment()
    process_rank = rank_zero_only.rank
    environment.set_global_rank(rank)  # (which also sets Lightning's process-wide rank: restored below)
    rank_zero_only.rank = process_rank
    environment.set_world_size(world_size)
    strategy = PRIVATE_STRATEGIES[name](**kwargs, parallel_devices=[torch.device("cpu")],
                                        cluster_environment=environment)
    strategy.topology = strategy.make_topology(world_size)
    return strategy


def offline_node(strategy: PrivateDecentralizedStrategy, secrets: Mapping[int, Any] | None = None) -> PrivateNodeAlgorithm:
    """The strategy's node algorithm; Decor's pairwise keys agreed in memory (``simulate_key_agreement``) instead of
    over the network."""
    node = strategy.make_node_algorithm()
    if secrets is not None:
        node.secrets = secrets[strategy.global_rank]  # type: ignore[attr-defined]
    return node


def train_offline(
    strategy: PrivateDecentralizedStrategy, node: PrivateNodeAlgorithm, model: nn.Module, dataset: Dataset, *,
    exchange: Exchange, batch_size: int, steps: int, lr: float, loss: Callable[..., Tensor],
) -> NodeRun:
    """:func:`~lightning_privdec.algorithms.simulation.train_node` with the strategy's graph, compressor, consensus
    step and seed; the strategy then holds the node's gossip (its ``consensus_step`` is the one chosen)."""
    assert strategy.topology is not None
    run = train_node(
        node, model, dataset, exchange=exchange, topology=strategy.topology, batch_size=batch_size, steps=steps, lr=lr,
        loss=loss, compressor=strategy.compressor, push_sum_weight=strategy.required_mixing == "column",
        consensus_step=strategy.consensus_step, seed=strategy.seed,
    )
    strategy.gossip = run.gossip
    return run
