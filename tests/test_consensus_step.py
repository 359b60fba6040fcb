"""consensus_step="auto": gamma from the compressor's omega^2 and the graph, on the loopback network."""

from __future__ import annotations

import pytest
import torch

from lightning_privdec import DecentralizedPushSumStrategy, DPCSGPStrategy
from lightning_privdec.algorithms import PushSumGossip
from lightning_privdec.algorithms.consensus_step import CALIBRATION, choco_step, choose_consensus_step
from lightning_privdec.comm import LoopbackNetwork
from lightning_privdec.compression import QSGD, Identity, RandK, Sign, TopK
from lightning_privdec.topology import build_topology

D = 1000


def test_choco_step_is_the_papers_formula():
    # Koloskova et al. 2019, Theorem 2: gamma* = rho^2 delta / (16 rho + rho^2 + 4 beta^2 + 2 rho beta^2 - 8 rho delta)
    rho, beta, delta = 0.5, 1.2, 0.3
    expected = rho**2 * delta / (16 * rho + rho**2 + 4 * beta**2 + 2 * rho * beta**2 - 8 * rho * delta)
    assert choco_step(delta, beta, rho) == pytest.approx(expected)


@pytest.mark.parametrize("compressor", [None, Identity()])
def test_exact_gossip_gets_gamma_one(compressor):
    topology = build_topology("exponential", 4, weights="push-sum")
    assert choose_consensus_step(compressor, topology, D).gamma == 1.0


def test_auto_gamma_values_for_common_pairs():
    exponential = build_topology("exponential", 4, weights="push-sum")
    one_peer = build_topology("exponential-one-peer", 8, weights="push-sum")
    # delta = 1 - omega^2 (this code base's contraction convention); beta = ||I - A||_2 = sqrt(10)/3 for exponential-4
    choice = choose_consensus_step(RandK(0.5), exponential, D)
    assert choice.beta == pytest.approx(10**0.5 / 3)
    assert choice.gamma == pytest.approx(CALIBRATION * 0.5 / (17 + 6 * 10 / 9 - 4))
    assert 0.2 < choice.gamma < 0.3 and choice.theory < 0.02  # the worst-case value is 16x smaller
    assert choose_consensus_step(RandK(0.5), one_peer, D).gamma == pytest.approx(5 / 19)  # beta = 1
    # more compression, a smaller step; never above 1
    gammas = [choose_consensus_step(c, exponential, D).gamma for c in (QSGD(8), RandK(0.5), RandK(0.1), TopK(0.01))]
    assert 1.0 >= gammas[0] > gammas[1] > gammas[2] > gammas[3] > 0
    assert choose_consensus_step(TopK(0.1), exponential, D).gamma == pytest.approx(gammas[2])


def test_auto_refuses_a_compressor_too_lossy_to_mix():
    topology = build_topology("exponential", 4, weights="push-sum")
    with pytest.raises(ValueError, match="no useful step for Sign"):
        choose_consensus_step(Sign(), topology, D)  # delta = 1/d


def consensus_error(topology, compressor, consensus_step, rounds=300) -> float:
    """Largest ||z_i - average|| / ||x_i(0) - average|| after ``rounds`` of gossip alone (lr = 0)."""
    n = topology.num_nodes
    g = torch.Generator().manual_seed(0)
    x0 = [torch.randn(D, generator=g) * (i + 1) for i in range(n)]
    average = torch.stack(x0).mean(0)

    def node(rank, exchange):
        gossip = PushSumGossip(x0[rank], rank=rank, topology=topology, exchange=exchange, compressor=compressor,
                               consensus_step=consensus_step, reference=torch.zeros(D))
        for _ in range(rounds):
            gossip.step(gossip.x)
        return gossip

    nodes = LoopbackNetwork(n).run(node)
    start = max((x - average).norm().item() for x in x0)
    return max((g.z - average).norm().item() for g in nodes) / start


@pytest.mark.parametrize("compressor", [RandK(0.1), TopK(0.1)], ids=["randk0.1", "topk0.1"])
def test_auto_consensus_step_converges_where_gamma_one_diverges(compressor):
    topology = build_topology("exponential", 4, weights="push-sum")
    assert consensus_error(topology, compressor, 1.0) > 1.0  # DP-CSGP's implicit gamma = 1 blows up
    assert consensus_error(topology, compressor, "auto") < 1e-2


def test_strategies_default_to_auto_and_an_explicit_number_wins():
    assert DecentralizedPushSumStrategy().consensus_step == "auto"
    assert DPCSGPStrategy(max_grad_norm=1.0, noise_multiplier=1.0).consensus_step == "auto"
    assert DecentralizedPushSumStrategy(consensus_step=0.3).consensus_step == 0.3
    with pytest.raises(ValueError, match="consensus_step"):
        DecentralizedPushSumStrategy(consensus_step="fast")
    topology = build_topology("exponential", 2, weights="push-sum")
    network = LoopbackNetwork(2)
    explicit = PushSumGossip(torch.zeros(D), rank=0, topology=topology, exchange=network.exchanges[0],
                             compressor=RandK(0.5), consensus_step=0.3)
    assert explicit.gamma == 0.3 and explicit.consensus_step_choice is None
    auto = PushSumGossip(torch.zeros(D), rank=0, topology=topology, exchange=network.exchanges[0],
                         compressor=RandK(0.5), consensus_step="auto")
    assert auto.gamma == choose_consensus_step(RandK(0.5), topology, D).gamma
