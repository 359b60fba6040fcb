"""Decor: pairwise-cancelling noise (loopback math), setup errors, and a real 4-process run with SecLDP accounting."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from lightning_privdec.algorithms.node import private_step
from lightning_privdec import CorrelatedNoiseStrategy, PrivacyConfigError
from lightning_privdec.algorithms.decor import decor_perturbation
from lightning_privdec.privacy.noise import node_noise_generator
from lightning_privdec.privacy.pairwise import CorrelatedNoise, simulate_key_agreement
from lightning_privdec.privacy.accounting.secldp_step import secldp_step
from lightning_privdec.privacy.accounting.secldp import secldp_epsilon_example_level
from lightning_privdec.topology import StaticTopology
from tests.multiprocess import fit_digits_in_one_launch


@pytest.mark.parametrize("graph", [nx.cycle_graph(6), nx.grid_2d_graph(3, 3, periodic=True)], ids=["ring", "torus"])
def test_correlated_noise_cancels_in_the_network_sum_and_leaves_the_local_noise(graph):
    graph = nx.convert_node_labels_to_integers(graph)
    secrets = simulate_key_agreement({i: sorted(graph.neighbors(i)) for i in graph})
    correlated = {i: CorrelatedNoise(secrets[i], sigma_cor=5.0) for i in graph}
    d, n = 1000, graph.number_of_nodes()
    for round_ in (0, 7):
        local_only = [
            decor_perturbation(d, round_, correlated=None, sigma_cdp=0.3, generator=node_noise_generator("cpu", i, i))
            for i in range(n)
        ]
        full = [
            decor_perturbation(d, round_, correlated=correlated[i], sigma_cdp=0.3,
                               generator=node_noise_generator("cpu", i, i))
            for i in range(n)
        ]
        # each message carries the large correlated noise ...
        assert all((f - l).std() > 5.0 for f, l in zip(full, local_only))
        # ... which cancels exactly in the sum over nodes, leaving only the independent noise
        torch.testing.assert_close(torch.stack(full).sum(0), torch.stack(local_only).sum(0), atol=1e-3, rtol=0)


def test_decor_arguments_and_graphs_are_checked_before_training():
    with pytest.raises(PrivacyConfigError, match="not both and not neither"):
        CorrelatedNoiseStrategy(max_grad_norm=1.0)
    with pytest.raises(PrivacyConfigError, match="adversary"):
        CorrelatedNoiseStrategy(max_grad_norm=1.0, sigma_cdp=1.0, sigma_cor=1.0, adversary="oracle")
    with pytest.raises(PrivacyConfigError, match="2-connected"):
        CorrelatedNoiseStrategy(topology=StaticTopology(nx.path_graph(4)), max_grad_norm=1.0, sigma_cdp=1.0,
                                sigma_cor=1.0, adversary="curious")
    with pytest.raises(Exception, match="undirected"):
        CorrelatedNoiseStrategy(topology=StaticTopology(nx.DiGraph(nx.cycle_graph(4, create_using=nx.DiGraph))),
                                max_grad_norm=1.0, sigma_cdp=1.0, sigma_cor=1.0)


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory):
    """One 4-process launch: a 10-epoch Decor run on a ring with its keys in files and a checkpoint every epoch, then
    a new Trainer and strategy in the same processes resuming its epoch-8 checkpoint (the keys read back from the
    files, the pairwise agreement run again); both fits' per-rank results and the directory."""
    root = tmp_path_factory.mktemp("decor")
    common = ["--strategy", "decor", "--topology", "ring", "--epsilon", "3", "--lr", "0.5", "--max-epochs", "10",
              "--noise-seed", "5", "--key-dir", str(root / "keys")]
    straight, resumed = fit_digits_in_one_launch(
        (root / "straight", [*common, "--ckpt-dir", str(root / "ckpt")]),
        (root / "resumed", [*common, "--resume", str(root / "ckpt" / "epoch=7-*.ckpt")]))
    return straight, resumed, root


@pytest.mark.multiprocess
def test_decor_trains_digits_on_a_ring_within_its_secldp_budget(ring_run):
    results, _, _ = ring_run
    node = results[0]
    assert min(r["test_acc"] for r in results) > 0.6
    # the reported epsilon is the SecLDP accountant's (eavesdropper, example level) for the calibrated pair
    step = secldp_step(nx.cycle_graph(4), node["sigma_cdp"], node["sigma_cor"], 1.0, "eavesdropper", level="example")
    expected = secldp_epsilon_example_level(step, node["ledger_steps"], 1e-5, node["sample_rate"])
    for r in results:
        assert r["epsilon"] == pytest.approx(expected, rel=1e-9)
        assert r["epsilon"] <= 3.0
        assert r["sigma_cor"] > 0  # the correlated noise is really used


def test_the_ldp_and_cdp_baselines_are_calibrated_from_the_same_budget():
    """Decor, its LDP baseline and its CDP level from one budget (the accuracy ordering Decor > LDP is measured by
    benchmarks/privacy_utility.py, a benchmark rather than a test)."""
    import networkx as nx

    from lightning_privdec.privacy import PrivacyParameters
    from lightning_privdec.algorithms.decor import DecorNode, DecorOptions

    def planned(baseline: str | None) -> DecorNode:
        dp = DecorNode(
            PrivacyParameters(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5), graph=nx.cycle_graph(4),
            options=DecorOptions(adversary="eavesdropper", clipping="per_sample", baseline=baseline),
            rank=0, device=torch.device("cpu"),
        )
        dp.sample_rate = 0.1
        dp.plan_noise(110)
        return dp

    decor, ldp, cdp = planned(None), planned("ldp"), planned("cdp")
    assert ldp.sigma_cor == 0 and cdp.sigma_cor == 0 and decor.sigma_cor > 0
    assert ldp.sigma_cdp > decor.sigma_cdp  # the correlated noise lets Decor's independent noise be smaller
    assert cdp.sigma_cdp == pytest.approx(ldp.sigma_cdp / 2, rel=1e-6)  # sigma_LDP / sqrt(n), n = 4
    for dp in (decor, ldp, cdp):
        assert 2.9 < dp.ledger.epsilon_after(110, dp.next_release()) <= 3.0


@pytest.mark.multiprocess
def test_a_resumed_decor_run_with_key_files_rederives_the_same_streams(ring_run):
    straight, resumed, root = ring_run
    keys = sorted(p.name for p in (root / "keys").iterdir())
    assert keys == [f"node_{i}.key" for i in range(4)]
    assert all(((root / "keys" / k).stat().st_mode & 0o777) == 0o600 for k in keys)
    assert not any(b"node_0.key" in checkpoint.read_bytes() for checkpoint in (root / "ckpt").glob("*.ckpt"))
    for a, b in zip(straight, resumed):
        assert b["ledger_steps"] == a["ledger_steps"] == 110  # the round counter continued from round 88
        assert (a["params"] == b["params"]).all()  # same pairwise secrets, same per-round streams


def test_the_budget_check_counts_the_steps_that_fit_and_agrees_with_the_accountant_at_every_step():
    """next_step_exceeds_budget finds once how many steps fit the target; it must answer as the accountant would."""
    import networkx as nx

    from lightning_privdec.privacy import PrivacyParameters
    from lightning_privdec.algorithms.decor import DecorNode, DecorOptions

    dp = DecorNode(
        PrivacyParameters(max_grad_norm=1.0, target_epsilon=2.0, target_delta=1e-5), graph=nx.cycle_graph(4),
        options=DecorOptions(sigma_cdp=20.0, sigma_cor=0.5, clipping="user"), rank=0, device=torch.device("cpu"),
    )
    dp.plan_noise(5)  # 16 steps fit: the search doubles past the plan, then bisects
    answers = []
    for steps in range(60):
        assert dp.steps == steps
        direct = dp.ledger.epsilon_after(1, dp.next_release()) > 2.0  # one more round
        assert dp.next_step_exceeds_budget() == direct, steps
        answers.append(direct)
        dp.ledger.record(dp.next_release())  # one more released round
    assert not answers[0] and answers[-1]  # the boundary lies inside the range checked


def ring_node(rank: int = 0, sigma_cdp: float = 20.0, sigma_cor: float = 0.5, clipping: str = "user"):  # noqa: ANN201
    from lightning_privdec.algorithms.decor import DecorNode, DecorOptions
    from lightning_privdec.privacy import PrivacyParameters

    return DecorNode(
        PrivacyParameters(max_grad_norm=1.0, noise_multiplier=1.0), graph=nx.cycle_graph(4),
        options=DecorOptions(sigma_cdp=sigma_cdp, sigma_cor=sigma_cor, clipping=clipping), rank=rank,
        device=torch.device("cpu"), noise_seed=rank,
    )


def test_privatize_releases_messages_whose_average_carries_only_the_independent_noise():
    """Lines 2-5 on four nodes of a ring at a zero gradient: each message has variance sigma_cdp^2 + 2 sigma_cor^2,
    the network average sigma_cdp^2 / n; every node's epsilon is one round of its SecLDP slope (Thm. 6)."""
    from lightning_privdec.privacy.accounting.secldp import secldp_epsilon

    n, d, sigma_cdp, sigma_cor = 4, 40_000, 0.5, 2.0
    secrets = simulate_key_agreement({i: sorted(nx.cycle_graph(n).neighbors(i)) for i in range(n)})
    messages = []
    for rank in range(n):
        node, model = ring_node(rank, sigma_cdp, sigma_cor), torch.nn.Linear(d, 1, bias=False)
        node.secrets = secrets[rank]
        node.attach(model)
        node.plan_noise(10)
        model.weight.grad = torch.zeros_like(model.weight)
        private_step(node)
        messages.append(model.weight.grad.reshape(-1).clone())
        slope = secldp_step(nx.cycle_graph(n), sigma_cdp, sigma_cor, 1.0, "eavesdropper", level="user")
        assert node.steps == 1 and node.epsilon() == pytest.approx(secldp_epsilon(slope, 1, node.delta), rel=1e-12)
    noise = torch.stack(messages)
    assert noise.var(dim=1).numpy() == pytest.approx([sigma_cdp**2 + 2 * sigma_cor**2] * n, rel=0.05)
    assert noise.mean(0).var().item() == pytest.approx(sigma_cdp**2 / n, rel=0.05)
