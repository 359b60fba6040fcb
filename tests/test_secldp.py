"""Tests for the SecLDP accountant of Decor (lightning_privdec.privacy.accounting.secldp)."""

from __future__ import annotations

import itertools
import math
import time

import networkx as nx
import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from scipy.optimize import minimize_scalar

from lightning_privdec.privacy import PrivacyConfigError, epsilon_for
from lightning_privdec.privacy.accounting.secldp_step import MAX_COLLUDING_SUBSETS, secldp_step, secldp_step_bound
from lightning_privdec.privacy.accounting.secldp import (
    calibrate_secldp,
    eps_step_for,
    ldp_sigma,
    secldp_epsilon,
    secldp_epsilon_example_level,
)
from lightning_privdec.topology import build_topology

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the")


def brute_force(graph: nx.Graph, sigma_cdp: float, sigma_cor: float, clip: float, q: int) -> float:
    """Decor Alg. 3 literally: dense inverse of sigma_cdp^2 I + sigma_cor^2 L_H for every colluding set."""
    graph = nx.Graph(graph)
    worst = 0.0
    for deleted in itertools.combinations(sorted(graph), q):
        honest = graph.subgraph(v for v in graph if v not in deleted)
        lap = nx.laplacian_matrix(honest, nodelist=sorted(honest)).toarray()
        inverse = np.linalg.inv(sigma_cdp**2 * np.eye(len(honest)) + sigma_cor**2 * lap)
        worst = max(worst, float(np.max(np.diag(inverse))))
    return 2.0 * clip**2 * worst


def ring(n: int) -> nx.DiGraph:
    return build_topology("ring", n).graph(0)


SMALL = {
    "ring16": lambda: ring(16),
    "torus16": lambda: build_topology("torus", 16).graph(0),
    "complete8": lambda: build_topology("complete", 8).graph(0),
    "erdos-renyi20": lambda: build_topology("erdos-renyi", 20, seed=3).graph(0),
    "barbell": lambda: nx.barbell_graph(4, 2),
    "star": lambda: nx.star_graph(7),
}
# above 64 honest nodes deletions go through the Woodbury update + refinement instead of refactorizing
LARGER = {
    "cycle90": lambda: nx.cycle_graph(90),
    "grid9x10": lambda: nx.grid_2d_graph(9, 10),
    "path75": lambda: nx.path_graph(75),
    "barbell30-12": lambda: nx.barbell_graph(30, 12),
}


# ---- the per-round accountant --------------------------------------------------------------------------------
@pytest.mark.parametrize("adversary", ["eavesdropper", "curious", 2, 15])
@pytest.mark.parametrize("name", ["ring16", "torus16", "complete8"])
def test_no_correlated_noise_is_ldp(name: str, adversary: str | int) -> None:
    graph = SMALL[name]()
    if isinstance(adversary, int) and adversary >= len(graph):
        adversary = len(graph) - 1
    assert secldp_step(graph, 1.7, 0.0, 0.6, adversary) == pytest.approx(2 * 0.6**2 / 1.7**2, rel=1e-12)
    assert secldp_step(graph, 1.7, 0.0, 0.6, adversary, level="example") == pytest.approx(
        0.6**2 / (2 * 1.7**2), rel=1e-12
    )


def test_n_minus_one_colluders_is_ldp() -> None:
    assert secldp_step(ring(6), 2.0, 50.0, 1.0, 5) == pytest.approx(2 / 4, rel=1e-12)


def test_complete_graph_approaches_cdp_level() -> None:
    n, sigma, clip = 16, 2.0, 1.5
    cdp_level = 2 * clip**2 / (n * sigma**2)
    values = [secldp_step(build_topology("complete", n).graph(0), sigma, s, clip) for s in (1.0, 10.0, 1e3)]
    assert values[0] > values[1] > values[2] > cdp_level
    assert values[2] == pytest.approx(cdp_level, rel=1e-4)


@pytest.mark.parametrize("name", ["ring16", "torus16", "erdos-renyi20"])
def test_non_increasing_in_sigma_cor(name: str) -> None:
    graph = SMALL[name]()
    for adversary in ("eavesdropper", "curious"):
        values = [secldp_step(graph, 1.0, s, 1.0, adversary) for s in np.geomspace(0.01, 1e3, 25)]
        assert all(b <= a * (1 + 1e-12) for a, b in zip(values, values[1:]))
        if adversary == "eavesdropper":  # (a curious neighbour of a degree-1 node sees it at the LDP level)
            assert values[0] > 1.5 * values[-1]


@pytest.mark.parametrize("name", sorted(SMALL))
def test_more_colluders_never_help(name: str) -> None:
    graph = SMALL[name]()
    values = [secldp_step(graph, 1.0, 3.0, 1.0, q) for q in range(4)]
    assert secldp_step(graph, 1.0, 3.0, 1.0, "eavesdropper") == values[0]
    assert secldp_step(graph, 1.0, 3.0, 1.0, "curious") == values[1]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(values, values[1:]))
    assert values[-1] <= 2.0 * (1 + 1e-12)  # never worse than LDP


def test_ring_collusion_isolates_a_node() -> None:
    # two colluders on both sides of a ring node see its release with only its own noise: LDP (Decor Sec. 4)
    assert secldp_step(ring(12), 1.0, 100.0, 1.0, 2) == pytest.approx(2.0, rel=1e-12)
    assert secldp_step(ring(12), 1.0, 100.0, 1.0, "curious") < 0.2


@pytest.mark.parametrize("q", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_matches_dense_brute_force_small(name: str, q: int) -> None:
    graph = SMALL[name]()
    for sigma_cor in (0.3, 3.0, 300.0):
        expected = brute_force(graph, 1.3, sigma_cor, 0.7, q)
        for method in ("auto", "banded", "dense"):
            assert secldp_step(graph, 1.3, sigma_cor, 0.7, q, method=method) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", sorted(LARGER))
def test_matches_dense_brute_force_woodbury_path(name: str) -> None:
    graph = LARGER[name]()
    max_degree = max(d for _, d in graph.degree)
    for sigma_cor in (0.5, 30.0, 3e3):  # up to rho ~ 1e7, with cut vertices (path, barbell)
        # any method (this one and the brute force alike) is only accurate to ~ machine epsilon * cond(Sigma)
        rel = max(1e-9, 1e-15 * (1 + 2 * max_degree * sigma_cor**2))
        for q in (0, 1):
            expected = brute_force(graph, 1.0, sigma_cor, 1.0, q)
            for method in ("banded", "dense"):
                value = secldp_step(graph, 1.0, sigma_cor, 1.0, q, method=method)
                assert value == pytest.approx(expected, rel=rel)


@pytest.mark.parametrize("q", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_exact_is_below_closed_form_bound(name: str, q: int) -> None:
    graph = SMALL[name]()
    for sigma_cor in (0.0, 0.5, 5.0, 500.0):
        exact = secldp_step(graph, 0.8, sigma_cor, 1.1, q)
        bound = secldp_step_bound(graph, 0.8, sigma_cor, 1.1, q)
        assert exact <= bound * (1 + 1e-9)


def test_bound_is_tight_on_complete_graph_and_loose_on_ring() -> None:
    complete = build_topology("complete", 12).graph(0)
    assert secldp_step(complete, 1.0, 4.0, 1.0) == pytest.approx(secldp_step_bound(complete, 1.0, 4.0, 1.0), rel=1e-9)
    assert secldp_step(ring(32), 1.0, 4.0, 1.0) < 0.5 * secldp_step_bound(ring(32), 1.0, 4.0, 1.0)


def test_bound_uses_algebraic_connectivity() -> None:
    n, sigma_cdp, sigma_cor = 20, 1.2, 3.0
    a = 2 - 2 * math.cos(2 * math.pi / n)  # algebraic connectivity of the ring
    expected = 2 * (1 / (n * sigma_cdp**2) + (1 - 1 / n) / (sigma_cdp**2 + a * sigma_cor**2))
    assert secldp_step_bound(ring(n), sigma_cdp, sigma_cor, 1.0) == pytest.approx(expected, rel=1e-9)
    assert secldp_step_bound(ring(n), sigma_cdp, sigma_cor, 1.0, algebraic_connectivity=a) == pytest.approx(expected)
    # a_1 of the ring = algebraic connectivity of the path on n - 1 nodes
    a_1 = 2 - 2 * math.cos(math.pi / (n - 1))
    m = n - 1
    expected_1 = 2 * (1 / (m * sigma_cdp**2) + (1 - 1 / m) / (sigma_cdp**2 + a_1 * sigma_cor**2))
    assert secldp_step_bound(ring(n), sigma_cdp, sigma_cor, 1.0, "curious") == pytest.approx(expected_1, rel=1e-9)


def test_graph_inputs() -> None:
    topology = build_topology("torus", 16)
    undirected = nx.Graph(topology.graph(0))
    relabelled = nx.relabel_nodes(undirected, {v: f"node{v:02d}" for v in undirected})
    value = secldp_step(topology.graph(0), 1.0, 2.0, 1.0)
    assert secldp_step(topology, 1.0, 2.0, 1.0) == value
    assert secldp_step(undirected, 1.0, 2.0, 1.0) == pytest.approx(value, rel=1e-12)
    assert secldp_step(relabelled, 1.0, 2.0, 1.0) == pytest.approx(value, rel=1e-12)
    with_loop = undirected.copy()
    with_loop.add_edge(0, 0)  # self-loops carry no pairwise noise
    assert secldp_step(with_loop, 1.0, 2.0, 1.0) == pytest.approx(value, rel=1e-12)


def test_directed_graphs_are_refused() -> None:
    with pytest.raises(PrivacyConfigError, match="undirected"):
        secldp_step(build_topology("directed-ring", 8), 1.0, 1.0, 1.0)
    with pytest.raises(PrivacyConfigError, match="undirected"):
        secldp_step(build_topology("directed-ring", 8).graph(0), 1.0, 1.0, 1.0)


def test_invalid_arguments() -> None:
    with pytest.raises(PrivacyConfigError, match="sigma_cdp"):
        secldp_step(ring(8), -1.0, 1.0, 1.0)
    with pytest.raises(PrivacyConfigError, match="sigma_cor"):
        secldp_step(ring(8), 1.0, float("nan"), 1.0)
    with pytest.raises(PrivacyConfigError, match="clip"):
        secldp_step(ring(8), 1.0, 1.0, 0.0)
    with pytest.raises(PrivacyConfigError, match="at most n - 1"):
        secldp_step(ring(8), 1.0, 1.0, 1.0, 8)
    with pytest.raises(PrivacyConfigError, match="unknown adversary"):
        secldp_step(ring(8), 1.0, 1.0, 1.0, "spy")
    with pytest.raises(PrivacyConfigError, match="level"):
        secldp_step(ring(8), 1.0, 1.0, 1.0, level="batch")  # type: ignore[arg-type]
    assert secldp_step(ring(8), 0.0, 1.0, 1.0) == math.inf


def test_too_many_colluding_sets_are_refused() -> None:
    assert math.comb(300, 2) > MAX_COLLUDING_SUBSETS
    with pytest.raises(ValueError, match=r"C\(300, 2\).*secldp_step_bound"):
        secldp_step(ring(300), 1.0, 1.0, 1.0, 2)
    # sigma_cor = 0 needs no enumeration, and the bound is available with a given a_q
    assert secldp_step(ring(300), 1.0, 0.0, 1.0, 2) == pytest.approx(2.0)
    assert secldp_step_bound(ring(300), 1.0, 1.0, 1.0, 2, algebraic_connectivity=0.0) == pytest.approx(2.0)


def test_large_graphs_are_fast() -> None:
    start = time.perf_counter()
    value = secldp_step(ring(2000), 1.0, 10.0, 1.0)
    assert time.perf_counter() - start < 30.0
    assert value == pytest.approx(secldp_step(ring(20), 1.0, 10.0, 1.0), rel=0.5)  # ring: ~independent of n
    start = time.perf_counter()
    curious = secldp_step(ring(1000), 1.0, 10.0, 1.0, "curious")
    assert time.perf_counter() - start < 30.0
    assert curious > value


# ---- composition and conversion ------------------------------------------------------------------------------
@pytest.mark.parametrize("eps_step, steps, delta", [(1e-4, 1000, 1e-5), (0.02, 50, 1e-6), (3.0, 1, 0.01)])
def test_closed_form_is_the_optimal_order(eps_step: float, steps: int, delta: float) -> None:
    log_inv_delta = math.log(1 / delta)

    def objective(log_alpha_minus_1: float) -> float:
        alpha = 1 + math.exp(log_alpha_minus_1)
        return steps * alpha * eps_step + log_inv_delta / (alpha - 1)

    numeric = minimize_scalar(objective, bounds=(-20, 20), method="bounded", options={"xatol": 1e-10}).fun
    assert secldp_epsilon(eps_step, steps, delta) == pytest.approx(numeric, rel=1e-8)


def test_inverse_round_trips() -> None:
    for target, steps, delta in [(1.0, 3500, 1e-5), (1e-3, 1000, 1e-5), (40.0, 10, 1e-3)]:
        eps_step = eps_step_for(target, steps, delta)
        assert secldp_epsilon(eps_step, steps, delta) == pytest.approx(target, rel=1e-10)
        assert eps_step_for(secldp_epsilon(2.5e-4, steps, delta), steps, delta) == pytest.approx(2.5e-4, rel=1e-10)
    assert secldp_epsilon(0.0, 100, 1e-5) == 0.0 and secldp_epsilon(math.inf, 100, 1e-5) == math.inf


@pytest.mark.parametrize("sigma, clip, sample_rate, steps", [(1.1, 1.0, 0.01, 1000), (0.8, 0.5, 0.05, 300),
                                                             (3.0, 2.0, 1.0, 40)])
def test_example_level_without_correlated_noise_is_dpsgd(sigma: float, clip: float, sample_rate: float,
                                                           steps: int) -> None:
    # noise N(0, sigma^2) on the clipped sum, sensitivity C (add/remove): DP-SGD with noise multiplier sigma / C
    eps_step = secldp_step(ring(16), sigma, 0.0, clip, "curious", level="example")
    assert eps_step == pytest.approx(clip**2 / (2 * sigma**2), rel=1e-12)
    ours = secldp_epsilon_example_level(eps_step, steps, 1e-5, sample_rate)
    assert ours == pytest.approx(epsilon_for(sigma / clip, sample_rate, steps, 1e-5, "rdp"), rel=1e-9)
    accountant = RDPAccountant()
    accountant.history = [(sigma / clip, sample_rate, steps)]
    assert ours == pytest.approx(accountant.get_epsilon(delta=1e-5), rel=1e-9)


def test_example_level_composes_before_converting() -> None:
    eps_step, steps, delta, q = secldp_step(ring(16), 0.9, 4.0, 1.0, level="example"), 1000, 1e-5, 0.02
    composed = secldp_epsilon_example_level(eps_step, steps, delta, q)
    # converting one round to (eps, delta) and then adding up T of them (basic composition) is far looser
    assert composed < 0.2 * steps * secldp_epsilon_example_level(eps_step, 1, delta, q)
    # and composition is over RDP: T rounds at rate q is Opacus's history (z, q, T)
    accountant = RDPAccountant()
    accountant.history = [(1 / math.sqrt(2 * eps_step), q, steps)]
    assert composed == pytest.approx(accountant.get_epsilon(delta=delta), rel=1e-12)
    assert secldp_epsilon_example_level(eps_step, steps, delta, q / 2) < composed  # amplification


# ---- baselines and calibration ---------------------------------------------------------------------------------
def test_baselines() -> None:
    eps_step, clip, n = 1e-3, 1.3, 16
    assert ldp_sigma(clip, eps_step) == pytest.approx(clip * math.sqrt(2) / math.sqrt(eps_step))
    assert secldp_step(ring(n), ldp_sigma(clip, eps_step), 0.0, clip) == pytest.approx(eps_step, rel=1e-12)
    complete = build_topology("complete", n).graph(0)
    sigma = ldp_sigma(clip, eps_step) / math.sqrt(n)  # the CDP baseline (Decor Sec. 6), for the complete graph
    assert secldp_step(complete, sigma, 1e4 * sigma, clip) == pytest.approx(eps_step, rel=1e-6)
    assert ldp_sigma(clip, eps_step, level="example") == pytest.approx(ldp_sigma(clip, eps_step) / 2)


@pytest.mark.parametrize("name, adversary", [("ring", "eavesdropper"), ("torus", "eavesdropper"), ("ring", "curious")])
def test_calibration_user_level(name: str, adversary: str) -> None:
    n = 16 if adversary == "eavesdropper" else 8
    graph = build_topology(name, n).graph(0) if name == "ring" or n == 16 else build_topology(name, 16).graph(0)
    result = calibrate_secldp(1.0, 1e-5, 1000, graph, 1.0, adversary, num_candidates=8)
    assert 0.99 <= result.epsilon <= 1.0 * (1 + 1e-9)
    assert result.level == "user" and result.sample_rate is None
    assert secldp_step(graph, result.sigma_cdp, result.sigma_cor, 1.0, adversary) == pytest.approx(
        result.epsilon_step, rel=1e-12
    )
    assert result.sigma_ldp == pytest.approx(ldp_sigma(1.0, eps_step_for(1.0, 1000, 1e-5)))
    assert result.sigma_cdp_floor == pytest.approx(result.sigma_ldp / math.sqrt(n))
    alternatives = result.alternatives
    assert len(alternatives) == 8
    assert not alternatives[0].feasible  # the CDP level needs sigma_cor -> infinity
    assert alternatives[-1].sigma_cdp == result.sigma_ldp and alternatives[-1].sigma_cor == 0.0  # the LDP level
    feasible = [c for c in alternatives if c.feasible]
    assert result.sigma_cdp == min(c.sigma_cdp for c in feasible) < 0.5 * result.sigma_ldp
    for candidate in feasible:
        assert candidate.sigma_cor is not None and candidate.sigma_cor <= result.sigma_cor_max
        assert 0.99 <= candidate.epsilon <= 1.0 * (1 + 1e-9)
    # smaller sigma_cdp needs more correlated noise
    cors = [c.sigma_cor for c in feasible]
    assert all(b <= a for a, b in zip(cors, cors[1:]))


def test_calibration_example_level() -> None:
    graph = ring(16)
    result = calibrate_secldp(1.0, 1e-5, 1000, graph, 1.0, sample_rate=64 / 3750, num_candidates=6)
    assert result.level == "example" and result.sample_rate == 64 / 3750
    assert 0.99 <= result.epsilon <= 1.0 * (1 + 1e-9)
    eps_step = secldp_step(graph, result.sigma_cdp, result.sigma_cor, 1.0, level="example")
    assert secldp_epsilon_example_level(eps_step, 1000, 1e-5, 64 / 3750) == pytest.approx(result.epsilon, rel=1e-9)
    assert len(result.alternatives) == 6 and result.sigma_cdp < result.sigma_ldp


def test_calibration_with_a_small_cap_falls_back_towards_ldp() -> None:
    graph = ring(16)
    loose = calibrate_secldp(1.0, 1e-5, 1000, graph, 1.0, num_candidates=6)
    tight = calibrate_secldp(1.0, 1e-5, 1000, graph, 1.0, num_candidates=6, sigma_cor_max=0.2 * loose.sigma_ldp)
    assert tight.sigma_cdp > loose.sigma_cdp and tight.sigma_cor <= 0.2 * loose.sigma_ldp
    with pytest.raises(PrivacyConfigError, match="num_candidates"):
        calibrate_secldp(1.0, 1e-5, 1000, graph, 1.0, num_candidates=1)
