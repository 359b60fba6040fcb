"""Start-up: every node begins from rank 0's parameters, and the full broadcast is skipped when they already agree."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_privdec.strategies import process_group as base


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 7), nn.GroupNorm(1, 7), nn.Linear(7, 3))
    net.register_buffer("steps", torch.tensor(seed))
    return net


def _node(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    broadcast = base._sync_module_states
    results = {}

    def refuse(module: nn.Module) -> None:
        raise AssertionError("the full broadcast ran although every node holds rank 0's parameters")

    base._sync_module_states = refuse  # same seed everywhere: no broadcast may run
    same = _net(0)
    results["same"] = (base.sync_module_states(same), torch.cat([t.flatten().float() for t in same.state_dict().values()]))
    base._sync_module_states = broadcast
    # one node differs in one buffer only: everyone must end with rank 0's values
    differ = _net(0)
    if rank == world - 1:
        differ.steps += 1
    results["buffer"] = (base.sync_module_states(differ), differ.steps.clone())
    mixed = _net(rank)  # every node seeded differently
    results["mixed"] = (base.sync_module_states(mixed),
                        torch.cat([t.flatten().float() for t in mixed.state_dict().values()]))
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_start_up_broadcast_runs_only_when_a_node_differs_from_rank_0(tmp_path):
    world = 3
    mp.start_processes(_node, args=(world, f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=world,
                       start_method="fork")
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    expected_same = torch.cat([t.flatten().float() for t in _net(0).state_dict().values()])
    expected_mixed = expected_same  # rank 0 seeded 0
    for r in results:
        ran, values = r["same"]
        assert not ran and torch.equal(values, expected_same)
        ran, steps = r["buffer"]
        assert ran and steps.item() == 0
        ran, values = r["mixed"]
        assert ran and torch.equal(values, expected_mixed)
    assert not torch.equal(torch.cat([t.flatten().float() for t in _net(1).state_dict().values()]), expected_same)
