"""Push-sum gossip math on the loopback exchange: n simulated nodes in one process."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from lightning_privdec.algorithms import PushSumGossip
from lightning_privdec.comm import LoopbackNetwork
from lightning_privdec.compression import QSGD, RandK, TopK
from lightning_privdec.topology import build_topology

D = 257


def start_points(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(D, generator=g) * (i + 1) for i in range(n)]


def run_gossip(n, topology, rounds, *, compressor=None, gamma=1.0, push_sum_weight=True, x0=None):
    """lr = 0: every round gossips the current numerator; returns each node's final gossip object."""
    x0 = start_points(n) if x0 is None else x0
    network = LoopbackNetwork(n)

    def node(rank, exchange):
        gossip = PushSumGossip(
            x0[rank],
            rank=rank,
            topology=topology,
            exchange=exchange,
            compressor=compressor,
            consensus_step=gamma,
            push_sum_weight=push_sum_weight,
        )
        for _ in range(rounds):
            gossip.step(gossip.x)
        return gossip

    return network.run(node), torch.stack(x0).mean(0)


@pytest.mark.parametrize("n", [5, 8, 12])
def test_exact_push_sum_reaches_the_exact_average_on_a_time_varying_directed_graph(n):
    topology = build_topology("exponential-one-peer", n, weights="push-sum")
    assert not topology.is_static and not topology.is_symmetric
    nodes, average = run_gossip(n, topology, rounds=120)
    for gossip in nodes:
        assert torch.allclose(gossip.z, average, atol=1e-5, rtol=0)
    # the push-sum weights are what make a directed graph work: they are far from 1 mid-way on n = 5, 12
    assert sum(float(g.y) for g in nodes) == pytest.approx(n, abs=1e-9)


def irregular_digraph(n: int) -> nx.DiGraph:
    """A directed ring with one chord: out-degrees differ, so push-sum mixing is not doubly stochastic."""
    graph = nx.DiGraph([(i, (i + 1) % n) for i in range(n)])
    graph.add_edge(0, n // 2)
    return graph


def test_push_sum_weights_remove_the_bias_of_an_irregular_directed_graph():
    n = 6
    topology = build_topology(irregular_digraph(n), n, weights="push-sum")
    with_weights, average = run_gossip(n, topology, rounds=400)
    without_weights, _ = run_gossip(n, topology, rounds=400, push_sum_weight=False)
    assert max((g.z - average).abs().max().item() for g in with_weights) < 1e-5
    assert max((g.z - average).abs().max().item() for g in without_weights) > 1e-2  # y is not decorative


@pytest.mark.parametrize(
    "compressor, gamma, rounds",
    # rounds: about twice what each needs to reach float32 resolution (QSGD(8) at gamma 1 by round 100, the
    # sparsifiers at their smaller gamma by round 400)
    [(QSGD(8), 1.0, 200), (RandK(0.5), 0.5, 600), (TopK(0.1), 0.2, 600)],
    ids=["qsgd8-gamma1", "randk0.5-gamma0.5", "topk0.1-gamma0.2"],
)
def test_compressed_push_sum_with_error_feedback_reaches_the_exact_average(compressor, gamma, rounds):
    n = 8
    topology = build_topology("exponential-one-peer", n, weights="push-sum")
    nodes, average = run_gossip(n, topology, rounds=rounds, compressor=compressor, gamma=gamma)
    for gossip in nodes:
        assert torch.allclose(gossip.z, average, atol=1e-5, rtol=0)
    # error feedback: every public copy (one per out-edge on a time-varying graph) caught up with its numerator
    for gossip in nodes:
        for copy in gossip.own_copies.values():
            assert torch.allclose(copy, gossip.x, atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec", ["exponential", "exponential-one-peer"])
def test_compression_never_changes_the_network_sum(spec):
    """Line 5 of DP-CSGP Algorithm 1 conserves sum_i x_i exactly, whatever the compressor does."""
    n = 6
    topology = build_topology(spec, n, weights="push-sum")
    x0 = start_points(n)
    total0 = torch.stack(x0).sum(0)
    nodes, _ = run_gossip(n, topology, rounds=7, compressor=RandK(0.1), x0=x0)
    total = torch.stack([g.x for g in nodes]).sum(0)
    assert torch.allclose(total, total0, atol=1e-4)
    assert sum(float(g.y) for g in nodes) == pytest.approx(n)


def test_dpsgd_on_an_undirected_ring_with_metropolis_weights():
    n = 7
    topology = build_topology("ring", n, weights="metropolis")
    nodes, average = run_gossip(n, topology, rounds=400, push_sum_weight=False)
    for gossip in nodes:
        assert float(gossip.y) == 1.0
        assert torch.allclose(gossip.x, average, atol=1e-5, rtol=0)


@pytest.mark.parametrize("compressor", [None, RandK(0.1), TopK(0.05), QSGD(8)], ids=str)
def test_bytes_on_the_wire_are_the_stated_sizes(compressor):
    n, rounds = 8, 9
    topology = build_topology("exponential", n, weights="push-sum")
    nodes, _ = run_gossip(n, topology, rounds=rounds, compressor=compressor)
    payload = 4 * D if compressor is None else compressor.encoded_nbytes(D)
    per_message = payload + 8  # + the float64 push-sum weight
    for gossip in nodes:
        degree = len(topology.out_peers(gossip.rank, 0))
        traffic = gossip.exchange.traffic
        assert traffic.last_bytes_sent == degree * per_message
        assert traffic.bytes_sent == rounds * degree * per_message
        assert traffic.bytes_received == rounds * len(topology.in_peers(gossip.rank, 0)) * per_message


def test_invalid_consensus_step_is_refused():
    topology = build_topology("ring", 3, weights="metropolis")
    network = LoopbackNetwork(3)
    with pytest.raises(ValueError, match="consensus_step"):
        PushSumGossip(torch.zeros(3), rank=0, topology=topology, exchange=network.exchanges[0], consensus_step=1.5)


def runner_trajectories(topology, n: int, steps: int, *, touch_at: int | None = None) -> list[dict]:
    """Every node's NodeRunner steps (a linear model, SGD, a fixed least-squares loss per node): its final
    parameters and x, whether each step loaded x into the parameters (the flat buffer written between the backward
    pass and the optimizer), and whether y was 1 after each step. ``touch_at``: after that step, an in-place write
    to node 0's weight (which loading x must undo)."""
    from lightning_privdec.algorithms.flat_parameters import FlatParameters
    from lightning_privdec.algorithms.node import NodeRunner

    torch.manual_seed(0)
    models = [torch.nn.Linear(6, 3) for _ in range(n)]
    data = [(torch.randn(16, 6), torch.randn(16, 3)) for _ in range(n)]

    def node(rank, exchange):
        model, (inputs, targets) = models[rank], data[rank]
        flat = FlatParameters(model)
        gossip = PushSumGossip(flat.buffer, rank=rank, topology=topology, exchange=exchange)
        runner = NodeRunner(model, flat, gossip, rank=rank)
        optimizer = torch.optim.SGD(flat.parameters, lr=0.1)
        loaded, unit_weight, after_backward = [], [], []

        def gradients():
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            after_backward.append(flat.buffer._version)
            return loss

        def update(closure):
            def recorded():
                loss = closure()
                loaded.append(flat.buffer._version != after_backward[-1])
                return loss

            return optimizer.step(recorded)

        for step in range(steps):
            optimizer.zero_grad()
            runner.step(optimizer, gradients, step=step, update=update)
            unit_weight.append(float(gossip.y) == 1.0)
            if step == touch_at and rank == 0:
                with torch.no_grad():
                    model.weight.add_(1.0)
        return {"buffer": flat.buffer.clone(), "x": gossip.x.clone(), "loaded": loaded, "unit_weight": unit_weight}

    return LoopbackNetwork(n).run(node)


def test_the_step_loads_x_into_the_parameters_only_when_they_may_not_hold_it(monkeypatch):
    """With y = 1 the de-biasing writes x itself, and the next step's optimizer updates the parameters without
    loading x first: bit for bit the trajectory that loads it every step, also when a parameter is written in place
    between steps (the next gradients are taken there, then the write is undone, either way). With y != 1 x is
    always loaded."""
    doubly = build_topology("exponential-one-peer", 4, weights="push-sum")  # 4 = 2^2 nodes: y stays 1
    skipped = runner_trajectories(doubly, 4, steps=6)
    touched = runner_trajectories(doubly, 4, steps=6, touch_at=2)
    monkeypatch.setattr(PushSumGossip, "debias_is_identity", lambda self: False)
    loaded = runner_trajectories(doubly, 4, steps=6)
    loaded_touched = runner_trajectories(doubly, 4, steps=6, touch_at=2)
    for a, b, c, d in zip(skipped, touched, loaded, loaded_touched):
        for key in ("buffer", "x"):
            assert torch.equal(a[key], c[key]) and torch.equal(b[key], d[key])
        assert not torch.equal(a["x"], b["x"])  # the write moved where step 3's gradients were taken
        assert c["loaded"] == [True] * 6 and d["loaded"] == [True] * 6
    assert all(node["loaded"] == [True] + [False] * 5 for node in skipped)  # only the first step loaded x
    assert touched[0]["loaded"] == [True, False, False, True, False, False]  # the write was seen, once
    monkeypatch.undo()
    irregular = runner_trajectories(build_topology(irregular_digraph(5), 5, weights="push-sum"), 5, steps=4)
    assert not all(all(node["unit_weight"]) for node in irregular)
    assert all(node["loaded"][1:] == [not unit for unit in node["unit_weight"][:-1]] for node in irregular)
