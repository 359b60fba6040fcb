"""Strategy-level behaviour that needs no second process: setup-time errors, registry, flat parameters."""

from __future__ import annotations

import lightning as L
import networkx as nx
import pytest
import torch
from torch import nn

from lightning_privdec import (
    DecentralizedPushSumStrategy,
    DecentralizedSGDStrategy,
    RandK,
    TopologyError,
)
from lightning_privdec.strategies import FlatParameters
from lightning_privdec.topology import StaticTopology


def trainer_with(strategy, devices: int = 4) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)


def test_graph_size_must_match_the_world_size_before_any_process_group_exists():
    trainer = trainer_with(DecentralizedPushSumStrategy(topology=nx.complete_graph(3).to_directed()))
    with pytest.raises(TopologyError, match="3.*4|4.*3"):
        trainer.strategy.setup_environment()
    assert not torch.distributed.is_initialized()


def test_a_symmetric_only_algorithm_refuses_a_directed_graph():
    trainer = trainer_with(DecentralizedSGDStrategy(topology="exponential"))
    with pytest.raises(TopologyError, match="undirected"):
        trainer.strategy.setup_environment()


def test_a_disconnected_user_graph_is_refused_when_the_strategy_is_built():
    with pytest.raises(TopologyError, match="connected"):
        DecentralizedSGDStrategy(topology=StaticTopology(nx.Graph([(0, 1), (2, 3)])))


def test_strategies_are_registered_by_name():
    assert isinstance(trainer_with("push_sum", devices=2).strategy, DecentralizedPushSumStrategy)
    assert isinstance(trainer_with("dpsgd", devices=2).strategy, DecentralizedSGDStrategy)


def test_a_multiprocessing_start_method_is_refused_where_the_launcher_started_the_processes():
    """Under torchrun or SLURM every process exists already: forking the ranks again would hang, not fail."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    class StartedByLauncher(LightningEnvironment):
        @property
        def creates_processes_externally(self) -> bool:
            return True

    with pytest.raises(ValueError, match="has already started them.*start_method='popen'"):
        L.Trainer(accelerator="cpu", devices=2, strategy=DecentralizedPushSumStrategy(start_method="fork"),
                  plugins=[StartedByLauncher()], logger=False)


def test_compressor_specs_and_bad_arguments():
    strategy = DecentralizedPushSumStrategy(compressor="randk:0.25")
    assert isinstance(strategy.compressor, RandK) and strategy.compressor.ratio == 0.25
    with pytest.raises(ValueError, match="consensus_step"):
        DecentralizedPushSumStrategy(consensus_step=0.0)
    with pytest.raises(ValueError):
        DecentralizedPushSumStrategy(compressor="zip:3")


def test_flat_parameters_are_views_and_optimizers_keep_working():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    flat = FlatParameters(model)
    assert flat.numel == sum(p.numel() for p in model.parameters())
    for p, old in zip(model.parameters(), before):
        assert torch.equal(p, old)
        assert p.data_ptr() >= flat.buffer.data_ptr()
    flat.buffer.fill_(1.0)  # writing the buffer writes the module
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    assert not torch.equal(flat.buffer, torch.ones_like(flat.buffer))  # the optimizer updated the buffer in place


def test_mixed_dtypes_are_refused_with_a_fix():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match="one dtype"):
        FlatParameters(model)
