"""Tests for lightning_privdec.topology: graphs, mixing weights, validation, spectral quantities."""

from __future__ import annotations

import math
import subprocess
import sys

import networkx as nx
import numpy as np
import pytest

from lightning_privdec.topology import (
    TOPOLOGY_NAMES,
    CompleteGraph,
    DirectedRing,
    ErdosRenyi,
    ExponentialGraph,
    OnePeerExponentialGraph,
    Ring,
    StaticTopology,
    TimeVaryingTopology,
    Topology,
    TopologyError,
    Torus,
    build_topology,
    torus_shape,
)


def edges(topology: Topology, round: int = 0) -> set[tuple[int, int]]:
    return set(topology.graph(round).edges)


def assert_push_sum(matrix: np.ndarray) -> None:
    assert (matrix >= 0).all()
    np.testing.assert_allclose(matrix.sum(axis=0), 1.0, atol=1e-12)


def assert_metropolis(matrix: np.ndarray) -> None:
    assert (matrix >= 0).all()
    np.testing.assert_allclose(matrix, matrix.T, atol=1e-12)
    np.testing.assert_allclose(matrix.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, atol=1e-12)


# ----------------------------------------------------------------------------- named graphs
def test_exponential_graph_edges_and_push_sum_weights() -> None:
    topology = ExponentialGraph(8)
    assert topology.out_peers(0, 0) == [1, 2, 4]
    assert topology.in_peers(0, 0) == [4, 6, 7]
    assert topology.out_peers(5, 7) == [1, 6, 7]
    assert topology.is_static and not topology.is_symmetric
    assert topology.weight_rule == "push-sum"
    matrix = topology.mixing_matrix(0)
    assert matrix.dtype == np.float64 and matrix.shape == (8, 8)
    assert_push_sum(matrix)
    assert matrix[1, 0] == pytest.approx(0.25) and matrix[0, 0] == pytest.approx(0.25)
    assert topology.in_weights(0, 0) == pytest.approx({0: 0.25, 4: 0.25, 6: 0.25, 7: 0.25})
    topology.validate(8)
    assert edges(ExponentialGraph(2)) == {(0, 1), (1, 0)}
    assert edges(ExponentialGraph(1)) == set()
    assert edges(ExponentialGraph(9), 0) >= {(0, 8)}  # 2^3 = 8 <= n - 1


def test_one_peer_exponential_schedule() -> None:
    topology = OnePeerExponentialGraph(8)
    assert topology.period == 3 and not topology.is_static
    for round, step in [(0, 1), (1, 2), (2, 4), (3, 1), (4, 2)]:
        assert edges(topology, round) == {(i, (i + step) % 8) for i in range(8)}
        assert topology.out_peers(3, round) == [(3 + step) % 8]
        assert_push_sum(topology.mixing_matrix(round))
    assert topology.mixing_matrix(3).tolist() == topology.mixing_matrix(0).tolist()
    topology.validate(8)
    assert OnePeerExponentialGraph(5).period == 3
    assert OnePeerExponentialGraph(2).period == 1 and edges(OnePeerExponentialGraph(2)) == {(0, 1), (1, 0)}
    assert OnePeerExponentialGraph(1).period == 1 and edges(OnePeerExponentialGraph(1)) == set()


def test_rings_complete_and_torus_edges() -> None:
    assert edges(DirectedRing(4)) == {(0, 1), (1, 2), (2, 3), (3, 0)}
    ring = Ring(4)
    assert ring.is_symmetric and ring.weight_rule == "metropolis"
    assert edges(ring) == {(0, 1), (1, 2), (2, 3), (3, 0), (1, 0), (2, 1), (3, 2), (0, 3)}
    assert_metropolis(ring.mixing_matrix(0))
    assert edges(Ring(2)) == {(0, 1), (1, 0)}
    assert Ring(2).mixing_matrix(0) == pytest.approx(np.full((2, 2), 0.5))
    assert edges(CompleteGraph(4)) == {(i, j) for i in range(4) for j in range(4) if i != j}
    torus = Torus(3, 4)
    assert torus.num_nodes == 12 and torus.is_symmetric
    assert torus.out_peers(0, 0) == [1, 3, 4, 8]  # right, left (wrap), down, up (wrap)
    assert all(d == 4 for _, d in torus.graph(0).out_degree)
    assert_metropolis(torus.mixing_matrix(0))
    assert Torus(2, 2).out_peers(0, 0) == [1, 2]  # wrap-around duplicates merged
    assert Torus(1, 3).out_peers(0, 0) == [1, 2]  # a side of length 1 adds no self-loops


def test_erdos_renyi_is_connected_and_deterministic() -> None:
    first, second = ErdosRenyi(12, 0.3, seed=5), ErdosRenyi(12, 0.3, seed=5)
    assert edges(first) == edges(second)
    assert nx.is_connected(first.graph(0).to_undirected())
    assert first.drawn_seed >= 5
    assert_metropolis(first.mixing_matrix(0))
    with pytest.raises(TopologyError, match=r"no connected Erdos-Renyi graph.*use a larger p"):
        ErdosRenyi(30, 0.01)
    with pytest.raises(TopologyError, match=r"p must be in \(0, 1\]"):
        ErdosRenyi(5, 0.0)


def test_weight_rules_and_with_weights() -> None:
    ring = Ring(6)
    np.testing.assert_allclose(ring.with_weights("push-sum").mixing_matrix(0), _ring_matrix(6))
    uniform = StaticTopology(nx.star_graph(3), weights="uniform").mixing_matrix(0)
    np.testing.assert_allclose(uniform.sum(axis=1), 1.0)
    assert uniform[0, 0] == pytest.approx(0.25) and uniform[1, 1] == pytest.approx(0.5)
    star = StaticTopology(nx.star_graph(3)).mixing_matrix(0)  # metropolis: 1 / (1 + max(3, 1))
    assert star[0, 1] == pytest.approx(0.25) and star[1, 1] == pytest.approx(0.75)
    assert_metropolis(star)
    assert ring.weights == "auto" and ring.with_weights("push-sum").weights == "push-sum"
    with pytest.raises(TopologyError, match="unknown weight rule 'foo'"):
        Ring(4, weights="foo")
    with pytest.raises(TopologyError, match=r"shape \(3, 3\) but the topology has 4 nodes"):
        Ring(4, weights=np.eye(3))


def _ring_matrix(n: int) -> np.ndarray:
    matrix = np.zeros((n, n))
    for i in range(n):
        matrix[i, [i, (i - 1) % n, (i + 1) % n]] = 1 / 3
    return matrix


def test_user_graphs_static_and_time_varying() -> None:
    labelled = StaticTopology(nx.grid_2d_graph(2, 2))  # tuple labels -> ranks in sorted order
    assert labelled.node_labels == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert labelled.out_peers(0, 0) == [1, 2]
    assert StaticTopology(nx.DiGraph([(0, 1), (1, 0), (1, 1)])).weight_rule == "push-sum"
    assert edges(StaticTopology(nx.Graph([(0, 1), (1, 1)]))) == {(0, 1), (1, 0)}  # self-loop ignored

    calls: list[int] = []

    def schedule(k: int) -> nx.DiGraph:
        calls.append(k)
        return nx.DiGraph([(0, 1), (2, 3)] if k == 0 else [(1, 2), (3, 0)])

    topology = TimeVaryingTopology(schedule, 4, 2)
    assert topology.out_peers(0, 0) == [1] and topology.out_peers(0, 1) == []
    assert topology.out_peers(0, 4) == [1] and topology.in_peers(0, 5) == [3]
    assert sorted(set(calls)) == [0, 1] and len(calls) == 2  # cached per round % period
    topology.validate(4)
    with pytest.raises(TopologyError, match=r"nodes must be the ranks 0\.\.3"):
        TimeVaryingTopology(lambda k: nx.path_graph(5), 4, 1).graph(0)


# ----------------------------------------------------------------------------- validation errors
def test_wrong_size() -> None:
    with pytest.raises(TopologyError, match=r"has 8 nodes but the world size is 4.*devices \* num_nodes"):
        Ring(8).validate(4)
    with pytest.raises(TopologyError, match="has 3 nodes but the world size is 4"):
        build_topology(nx.path_graph(3), 4)


def test_disconnected_static_graph() -> None:
    graph = nx.Graph([(0, 1), (2, 3)])
    with pytest.raises(TopologyError, match=r"graph of topology 'custom' is not connected: 2 components"):
        StaticTopology(graph).validate(4)
    with pytest.raises(TopologyError, match="is not strongly connected"):
        StaticTopology(nx.DiGraph([(0, 1), (1, 2)])).validate(3)


def test_time_varying_union_not_strongly_connected() -> None:
    topology = TimeVaryingTopology(lambda k: nx.DiGraph([(0, 1)] if k == 0 else [(1, 2)]), 3, 2)
    with pytest.raises(TopologyError, match=r"union of the graphs over one period \(2 rounds\).*not strongly"):
        topology.validate(3)


def test_negative_non_stochastic_and_off_graph_weights() -> None:
    negative = np.array([[1.5, -0.5, 0.0], [-0.5, 1.0, 0.5], [0.0, 0.5, 0.5]])
    with pytest.raises(TopologyError, match=r"A\[0, 1\] = -0.5 is negative"):
        Ring(3, weights=negative).validate(3, mixing="doubly")
    half = np.full((3, 3), 0.5)
    with pytest.raises(TopologyError, match=r"column 0 sums to 1.5.*push-sum"):
        Ring(3, weights=half).validate(3, mixing="column")
    rows_only = np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.5, 0.0, 0.5]])
    Ring(3, weights=rows_only).validate(3, mixing="row")
    with pytest.raises(TopologyError, match=r"column 0 sums to 1\.5"):
        Ring(3, weights=rows_only).validate(3, mixing="doubly")
    columns_only = rows_only.T.copy()
    with pytest.raises(TopologyError, match=r"row 0 sums to 1\.5, but mixing='row'"):
        Ring(3, weights=columns_only).validate(3, mixing="row")
    with pytest.raises(TopologyError, match=r"A\[0, 1\] = 0.5 but 1->0 is not an edge.*set it to 0"):
        DirectedRing(3, weights=rows_only).validate(3, mixing="row")
    with pytest.raises(TopologyError, match="unknown mixing mode"):
        Ring(3).validate(3, mixing="sideways")


def test_symmetry_requirements() -> None:
    with pytest.raises(TopologyError, match=r"needs an undirected graph \(symmetric weights\); use 'ring'"):
        ExponentialGraph(8).validate(8, mixing="doubly", require_symmetric=True)
    symmetric = np.array([[0.4, 0.35, 0.25], [0.35, 0.4, 0.25], [0.25, 0.25, 0.5]])
    Ring(3, weights=symmetric).validate(3, mixing="doubly", require_symmetric=True)
    skewed = np.array([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.3, 0.2, 0.5]])
    Ring(3, weights=skewed).validate(3, mixing="doubly")
    with pytest.raises(TopologyError, match="needs symmetric weights"):
        Ring(3, weights=skewed).validate(3, mixing="doubly", require_symmetric=True)


def test_metropolis_on_directed_graph() -> None:
    with pytest.raises(TopologyError, match=r"weights='metropolis' needs an undirected graph.*push-sum"):
        DirectedRing(4, weights="metropolis").validate(4)
    with pytest.raises(TopologyError, match="weights='metropolis' needs an undirected graph"):
        build_topology("exponential", 8, weights="metropolis").mixing_matrix(0)


def test_factory_names_and_errors() -> None:
    assert set(TOPOLOGY_NAMES) == {
        "exponential", "exponential-one-peer", "ring", "directed-ring", "complete", "torus", "erdos-renyi",
    }
    assert isinstance(build_topology("Exponential_One_Peer", 8), OnePeerExponentialGraph)
    torus = build_topology("torus", 12)
    assert isinstance(torus, Torus) and (torus.rows, torus.cols) == (3, 4)
    assert torus_shape(16) == (4, 4) and torus_shape(8) == (2, 4)
    with pytest.raises(TopologyError, match="no such factorisation; use 'ring'"):
        build_topology("torus", 7)
    with pytest.raises(TopologyError, match=r"unknown topology 'star'; valid names are \['exponential'"):
        build_topology("star", 4)
    with pytest.raises(TopologyError, match=r"wrap it as TimeVaryingTopology\(fn, num_nodes, period\)"):
        build_topology(lambda k: nx.cycle_graph(4), 4)
    with pytest.raises(TopologyError, match="unsupported topology spec of type int"):
        build_topology(3, 4)
    assert build_topology("erdos-renyi", 10, seed=3, erdos_renyi_p=0.5).p == 0.5


def test_factory_reweights_only_auto_objects() -> None:
    auto = Ring(5)
    assert build_topology(auto, 5, weights="push-sum").weight_rule == "push-sum"
    assert auto.weight_rule == "metropolis"  # the original is not modified
    explicit = Ring(5, weights="uniform")
    assert build_topology(explicit, 5, weights="push-sum") is explicit
    time_varying = TimeVaryingTopology(lambda k: nx.cycle_graph(5), 5, 1)
    assert build_topology(time_varying, 5, weights="push-sum").weight_rule == "push-sum"


# ----------------------------------------------------------------------------- spectral quantities
def test_complete_graph_averages_in_one_round() -> None:
    assert CompleteGraph(6).consensus_rate() == pytest.approx(0.0, abs=1e-12)
    assert CompleteGraph(6).spectral_gap() == pytest.approx(1.0)


@pytest.mark.parametrize("n", [5, 8, 11])
def test_ring_spectrum_closed_forms(n: int) -> None:
    ring = Ring(n)
    np.testing.assert_allclose(ring.mixing_matrix(0), _ring_matrix(n))  # metropolis = 1/3 on a ring
    assert ring.consensus_rate() == pytest.approx(1 / 3 + 2 / 3 * math.cos(2 * math.pi / n))
    assert ring.algebraic_connectivity() == pytest.approx(2 - 2 * math.cos(2 * math.pi / n))


def test_directed_ring_rate_and_directed_connectivity_error() -> None:
    assert DirectedRing(8).consensus_rate() == pytest.approx(math.cos(math.pi / 8))  # |(1 + e^{2πi/8}) / 2|
    with pytest.raises(TopologyError, match="algebraic connectivity is defined for undirected graphs"):
        DirectedRing(8).algebraic_connectivity()


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_one_peer_exponential_period_product_is_exact_average(n: int) -> None:
    topology = OnePeerExponentialGraph(n)
    np.testing.assert_allclose(topology.period_product(), np.full((n, n), 1 / n), atol=1e-14)
    assert topology.consensus_rate() == pytest.approx(0.0, abs=1e-12)


def test_irregular_push_sum_rate_is_second_eigenvalue_modulus() -> None:
    graph = nx.DiGraph([(i, (i + 1) % 6) for i in range(6)] + [(i, 0) for i in range(2, 6)])
    topology = StaticTopology(graph)
    matrix = topology.mixing_matrix(0)
    moduli = np.sort(np.abs(np.linalg.eigvals(matrix)))
    assert topology.consensus_rate() == pytest.approx(moduli[-2])
    assert 0 < topology.consensus_rate() < 1


def test_describe() -> None:
    info = Ring(8).describe()
    assert info["name"] == "ring" and info["num_nodes"] == 8 and info["period"] == 1
    assert info["symmetric"] is True and info["weights"] == "metropolis"
    assert info["consensus_rate"] + info["spectral_gap"] == pytest.approx(1.0)
    assert "algebraic_connectivity" in info
    assert "algebraic_connectivity" not in OnePeerExponentialGraph(8).describe()


# ----------------------------------------------------------------------------- property test
def _push_sum_average(topology: Topology, x0: np.ndarray, rounds: int) -> np.ndarray:
    matrices = [topology.mixing_matrix(k) for k in range(topology.period)]
    x, y = x0.copy(), np.ones_like(x0)
    for k in range(rounds):
        x, y = matrices[k % topology.period] @ x, matrices[k % topology.period] @ y
    return x / y


@pytest.mark.parametrize("name", TOPOLOGY_NAMES)
@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
def test_every_named_topology_validates_and_push_sum_converges(name: str, n: int) -> None:
    if name == "torus" and torus_shape_error(n):
        with pytest.raises(TopologyError, match="no such factorisation"):
            build_topology(name, n)
        return
    topology = build_topology(name, n)
    mixing = "column" if topology.weight_rule == "push-sum" else "doubly"
    topology.validate(n, mixing=mixing, require_symmetric=topology.is_symmetric)
    push_sum = build_topology(name, n, weights="push-sum")
    push_sum.validate(n, mixing="column")
    x0 = np.random.default_rng(n).normal(size=n)
    # 3000 rounds: the slowest case, the directed ring with n = 16, contracts by cos(π/16) ≈ 0.981 per round.
    z = _push_sum_average(push_sum, x0, rounds=3000)
    np.testing.assert_allclose(z, x0.mean(), atol=1e-8)


def torus_shape_error(n: int) -> bool:
    try:
        torus_shape(n)
    except TopologyError:
        return True
    return False


def test_topology_package_does_not_import_torch() -> None:
    # The parent package may import the strategies (and torch) eagerly, so load the topology
    # subpackage under a stub parent: this checks that topology itself needs neither torch nor lightning.
    code = (
        "import importlib.util, sys, types\n"
        "spec = importlib.util.find_spec('lightning_privdec')\n"
        "stub = types.ModuleType('lightning_privdec'); stub.__path__ = list(spec.submodule_search_locations)\n"
        "sys.modules['lightning_privdec'] = stub\n"
        "import lightning_privdec.topology as topology\n"
        "topology.build_topology('ring', 4).validate(4, mixing='doubly')\n"
        "print(sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
