"""CPGT (Xie et al.): Algorithm 1 against its matrix form, DiaDSP, the tracking invariant, Theorem 2 and its proof's
coupling, the least-squares experiment's linear rate, and the node state's checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import torch

from lightning_privdec.algorithms.cpgt import CHANNEL_X, CHANNEL_Y, NOISE_STREAM, CPGTGossip, laplace_noise
from lightning_privdec.algorithms.mixing import message_key
from lightning_privdec.comm.loopback import LoopbackNetwork
from lightning_privdec.compression import QSGD, Identity, TopK
from lightning_privdec.privacy import PrivacyConfigError
from lightning_privdec.privacy.accounting.cpgt import (
    calibrate_cpgt_noise,
    check_theorem2,
    clipping_sensitivity,
    cpgt_epsilon,
    cpgt_epsilon_after,
    cpgt_epsilon_for,
    laplace_norm_factor,
    min_noise_decay,
    theorem2_epsilon,
)
from lightning_privdec.privacy.noise import node_noise_generator
from lightning_privdec.strategies import PRIVATE_STRATEGIES, CPGTStrategy
from lightning_privdec.algorithms.cpgt import plain_sgd_step_size
from lightning_privdec.topology import TopologyError, build_topology
from tests.scripts_as_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
EDGES = [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)]  # 4 agents: a ring with one chord
N, D = 4, 5


def quadratic_problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """f_i(x) = 1/2 x^T H_i x - b_i^T x with H_i = M_i^T M_i / D (positive semi-definite, L about 1)."""
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(N, D, D, generator=g, dtype=torch.float64)
    return M.transpose(1, 2) @ M / D, torch.randn(N, D, generator=g, dtype=torch.float64)


def run_cpgt(compressor, gamma: float, alpha: float, steps: int, H, b, x0, *, noise=(0.3, 0.2), q=0.8, seed=5):
    """Run CPGTGossip on the loopback network; every agent returns its states x(0..K) and its y(0..K-1)."""
    topology = build_topology(nx.Graph(EDGES), N, weights="metropolis")

    def agent(rank, exchange):
        node = CPGTGossip(x0[rank], rank=rank, topology=topology, exchange=exchange, compressor=compressor,
                          consensus_step=gamma, noise_x=noise[0], noise_y=noise[1], noise_decay=q, noise_seed=seed,
                          seed=seed)
        xs, ys, noises = [node.x.clone()], [], []
        for _ in range(steps):
            y = node.track(H[rank] @ node.x - b[rank]).clone()
            node.step(node.x - alpha * y)
            xs.append(node.x.clone())
            ys.append(y)
            noises.append(node.last_noise[1].clone())
        return torch.stack(xs), torch.stack(ys), torch.stack(noises), node

    return LoopbackNetwork(N).run(agent), topology


def matrix_form(compressor, gamma, alpha, steps, H, b, x0, *, noise=(0.3, 0.2), q=0.8, seed=5):
    """Eqs. (5)-(12) for all agents at once, with the same noise streams and compressor keys."""
    W = torch.tensor(build_topology(nx.Graph(EDGES), N, weights="metropolis").mixing_matrix(0))
    gens = [node_noise_generator("cpu", seed, i, stream=NOISE_STREAM) for i in range(N)]
    C = compressor or Identity()

    def grad(X):
        return torch.stack([H[i] @ X[i] - b[i] for i in range(N)])

    def compress(V, channel, k):
        return torch.stack([C.compress(V[i], message_key(seed, i, channel, k)) for i in range(N)])

    X, Xc, Yc = x0.clone(), torch.zeros(N, D, dtype=torch.float64), torch.zeros(N, D, dtype=torch.float64)
    Y = grad(X)  # y_i(0) = grad f_i(x_i(0))
    xs = [X]
    for k in range(steps):
        Ex = torch.zeros(N, D, dtype=torch.float64)
        Ey = torch.zeros(N, D, dtype=torch.float64)
        for i in range(N):  # line 5: eta_x then eta_y from agent i's own generator
            Ex[i] = laplace_noise(D, noise[0] * q**k, gens[i])
            Ey[i] = laplace_noise(D, noise[1] * q**k, gens[i])
        Xa, Ya = X + Ex, Y + Ey  # (5)-(6)
        Xc = Xc + compress(Xa - Xc, CHANNEL_X, k)  # (11)
        Yc = Yc + compress(Ya - Yc, CHANNEL_Y, k)  # (12)
        I = torch.eye(N, dtype=torch.float64)
        X_next = Xa + gamma * (W - I) @ Xc - alpha * Y  # (9): row i is x_i^a + gamma sum_j w_ij (x_j^c - x_i^c)
        Y = Ya + gamma * (W - I) @ Yc + grad(X_next) - grad(X)  # (10)
        X = X_next
        xs.append(X)
    return torch.stack(xs)


@pytest.mark.parametrize("compressor", [TopK(0.4), QSGD(2)], ids=["top2", "2bit"])
def test_cpgt_equals_a_direct_matrix_transcription_of_algorithm_1(compressor):
    H, b = quadratic_problem()
    x0 = torch.rand(N, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (results, topology) = run_cpgt(compressor, 0.3, 0.05, 8, H, b, x0)
    nodes = torch.stack([r[0] for r in results], dim=1)  # (K+1, N, D)
    expected = matrix_form(compressor, 0.3, 0.05, 8, H, b, x0)
    torch.testing.assert_close(nodes, expected, rtol=0, atol=1e-12)
    assert not torch.allclose(nodes[1], nodes[0])  # something happened
    # the two compressed differences are the only messages: exact bytes per round
    per_message = 2 * compressor.encoded_nbytes(D, torch.float64)
    for rank, (_, _, _, node) in enumerate(results):
        assert node.exchange.traffic.bytes_sent == 8 * per_message * len(topology.out_peers(rank, 0))


def test_identity_compressor_with_gamma_one_is_diadsp():
    H, b = quadratic_problem(2)
    x0 = torch.rand(N, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    alpha, q, noise, seed, steps = 0.1, 0.7, (0.5, 0.4), 11, 10
    results, _ = run_cpgt(None, 1.0, alpha, steps, H, b, x0, noise=noise, q=q, seed=seed)
    W = torch.tensor(build_topology(nx.Graph(EDGES), N, weights="metropolis").mixing_matrix(0))
    gens = [node_noise_generator("cpu", seed, i, stream=NOISE_STREAM) for i in range(N)]
    X = x0.clone()
    Y = torch.stack([H[i] @ X[i] - b[i] for i in range(N)])
    for k in range(steps):  # DiaDSP (Ding et al. 2021), eqs. (7)-(8)
        Ex = torch.stack([laplace_noise(D, noise[0] * q**k, g) for g in gens])  # each agent: eta_x, then eta_y
        Ey = torch.stack([laplace_noise(D, noise[1] * q**k, g) for g in gens])
        X_next = W @ (X + Ex) - alpha * Y
        Y = W @ (Y + Ey) + torch.stack([H[i] @ (X_next[i] - X[i]) for i in range(N)])
        X = X_next
    torch.testing.assert_close(torch.stack([r[0][-1] for r in results]), X, rtol=0, atol=1e-12)


def test_tracking_invariant_holds_under_compression():
    """1^T y(k) = 1^T grad f(x(k)) + 1^T sum_{t<k} eta_y(t) (eq. 25), whatever the compressor does."""
    H, b = quadratic_problem(4)
    x0 = torch.rand(N, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    results, _ = run_cpgt(QSGD(2), 0.2, 0.05, 12, H, b, x0)
    xs = torch.stack([r[0] for r in results], dim=1)
    ys = torch.stack([r[1] for r in results], dim=1)
    noise_y = torch.stack([r[2] for r in results], dim=1)
    for k in range(12):
        grads = sum(H[i] @ xs[k, i] - b[i] for i in range(N))
        torch.testing.assert_close(ys[k].sum(0), grads + noise_y[:k].sum((0, 1)), rtol=0, atol=1e-10)
    assert noise_y[:3].abs().sum() > 0  # the invariant is not trivially noise-free


# ---- Theorem 2 -------------------------------------------------------------------------------------------------
def test_theorem2_numbers_and_the_sound_bound():
    alpha, L, q, dx, dy, delta = 0.1, 2.0, 0.9, 2.0, 4.0, 0.5
    series = q * q * delta / (q * q - alpha * L - q * alpha * L)
    assert theorem2_epsilon(alpha=alpha, lipschitz=L, q=q, noise_x=dx, noise_y=dy, sensitivity=delta) == \
        pytest.approx((alpha / dx + 1 / dy) * series, rel=1e-14)
    sound = cpgt_epsilon(alpha=alpha, lipschitz=L, q=q, noise_x=dx, noise_y=dy, sensitivity=delta, norm_factor=3.0)
    assert sound == pytest.approx(3.0 * (alpha / (q * dx) + 1 / dy) * series, rel=1e-14)
    assert laplace_norm_factor(9, "l2") == 3.0 and laplace_norm_factor(9, "l1") == 1.0
    assert clipping_sensitivity(1.5, 30.0) == pytest.approx(0.1)
    assert min_noise_decay(0.1, 2.0) == pytest.approx((0.2 + math.sqrt(0.04 + 0.8)) / 2)
    # the finite-horizon coupling increases to the closed form (Assumption 4) ...
    common = dict(alpha=alpha, lipschitz=L, q=q, noise_x=dx, noise_y=dy, sensitivity=delta)
    partial = [cpgt_epsilon_after(k, **common) for k in (0, 1, 5, 50, 2000)]
    assert partial[0] == 0 and partial == sorted(partial)
    assert partial[-1] == pytest.approx(cpgt_epsilon(**common), rel=1e-9)
    # ... and without it the bound grows without limit
    assert cpgt_epsilon_after(2000, **common, linear_difference=False) > 1e6 * partial[-1]
    # calibration: both scales d give exactly the target
    d = calibrate_cpgt_noise(3.0, "sound", steps=None, alpha=alpha, lipschitz=L, q=q, sensitivity=delta)
    assert cpgt_epsilon(alpha=alpha, lipschitz=L, q=q, noise_x=d, noise_y=d, sensitivity=delta) == pytest.approx(3.0)
    d = calibrate_cpgt_noise(3.0, "finite", steps=40, alpha=alpha, lipschitz=L, q=q, sensitivity=delta)
    assert cpgt_epsilon_for("finite", steps=40, noise_x=d, noise_y=d, **{k: common[k] for k in
                            ("alpha", "lipschitz", "q", "sensitivity")}) == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("alpha", "L", "q", "message"),
    [
        (0.3, 2.0, 0.99, "alpha < 1/(2L): alpha = 0.3 and L = 2 give alpha L = 0.6 >= 0.5"),
        (0.1, 2.0, 0.5, "q in ((alpha L + sqrt(alpha^2 L^2 + 4 alpha L)) / 2, 1) = (0.5583, 1)"),
        (0.1, 2.0, 1.0, "got q = 1"),
        (0.0, 2.0, 0.9, "step size alpha (the SGD learning rate) must be a finite number > 0"),
        (0.1, -1.0, 0.9, "smoothness constant L (lipschitz) must be a finite number > 0"),
    ],
)
def test_every_violated_condition_is_named_with_its_numbers(alpha, L, q, message):
    with pytest.raises(PrivacyConfigError) as info:
        check_theorem2(alpha, L, q)
    assert message in str(info.value)
    with pytest.raises(PrivacyConfigError):
        theorem2_epsilon(alpha=alpha, lipschitz=L, q=q, noise_x=1, noise_y=1, sensitivity=1)


def coupled_privacy_loss(d: int, steps: int, alpha: float, L: float, q: float, dx: float, dy: float, delta: float):
    """Run DiaDSP twice on two agents, agent 0 holding f(x) = L/2 ||x||^2 or f'(x) = f(x) + c^T x (||c||_2 = delta,
    spread evenly: Assumption 4), with the second run's noise chosen so that every message is identical (Theorem 2's
    coupling); returns the messages' largest difference and the Laplace log-density ratio of the two noise
    sequences, sum_k ||eta - eta'||_1 / (d q^k)."""
    W = torch.full((2, 2), 0.5, dtype=torch.float64)
    c = torch.full((d,), delta / math.sqrt(d), dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, d, generator=g, dtype=torch.float64)
    noise = node_noise_generator("cpu", 0, 0)
    grads = [lambda v: L * v, lambda v: L * v + 1.0]  # agent 1's function is the same in both runs
    runs = []
    for shift in (torch.zeros(d, dtype=torch.float64), c):
        def grad(X, shift=shift):
            return torch.stack([L * X[0] + shift, grads[1](X[1])])

        runs.append({"X": x.clone(), "Y": grad(x), "grad": grad})
    loss, gap = 0.0, 0.0
    for k in range(steps):
        one, two = runs
        eta_x = torch.stack([laplace_noise(d, dx * q**k, noise) for _ in range(2)])
        eta_y = torch.stack([laplace_noise(d, dy * q**k, noise) for _ in range(2)])
        # run two's noise absorbs its state difference: x^a and y^a (hence every message) are identical
        eta_x2, eta_y2 = eta_x - (two["X"] - one["X"]), eta_y - (two["Y"] - one["Y"])
        loss += float((eta_x2 - eta_x)[0].abs().sum()) / (dx * q**k)
        loss += float((eta_y2 - eta_y)[0].abs().sum()) / (dy * q**k)
        for run, ex, ey in ((one, eta_x, eta_y), (two, eta_x2, eta_y2)):
            Xa, Ya = run["X"] + ex, run["Y"] + ey
            run["messages"] = (Xa, Ya)
            X_next = W @ Xa - alpha * run["Y"]
            run["Y"] = W @ Ya + run["grad"](X_next) - run["grad"](run["X"])
            run["X"] = X_next
        gap = max(gap, max(float((a - b).abs().max()) for a, b in zip(one["messages"], two["messages"])))
    return gap, loss


@pytest.mark.parametrize("d", [1, 4])
def test_the_proofs_coupling_attains_the_sound_bound_which_exceeds_equation_23(d):
    alpha, L, q, dx, dy, delta = 0.2, 1.0, 0.8, 1.0, 2.0, 0.3
    gap, loss = coupled_privacy_loss(d, 60, alpha, L, q, dx, dy, delta)  # (0.56 / 0.8)^60: converged
    assert gap < 1e-12  # identical observations
    common = dict(alpha=alpha, lipschitz=L, q=q, noise_x=dx, noise_y=dy, sensitivity=delta)
    sound = cpgt_epsilon(**common, norm_factor=laplace_norm_factor(d, "l2"))
    assert loss == pytest.approx(sound, rel=1e-6)  # the bound is attained: it cannot be lowered for this coupling
    assert loss > theorem2_epsilon(**common) * (1.05 if d == 1 else 1.9)  # eq. (23) understates it


# ---- the paper's experiment: linear convergence -----------------------------------------------------------------
def load_benchmark():
    return load_script(ROOT / "benchmarks" / "cpgt_least_squares.py")


@pytest.mark.slow  # two 300-round runs of the paper's experiment
@pytest.mark.parametrize("name", ["DiaDSP", "CPGT-C2-1"])
def test_least_squares_residual_decays_geometrically_at_the_noise_rate(name):
    bench = load_benchmark()
    torch.set_num_threads(1)
    A, b = bench.make_problem(0, 0.5)
    (variant,) = [v for v in bench.VARIANTS if v.name == name]
    # one seeded run: its fitted rate is within 0.0025 of the mean of 4 runs' for both variants, the tolerance is 0.006
    curve = bench.run_once(variant, A, b, 300, 17)
    rate = bench.fitted_rate(curve)
    assert rate < 1 and curve[-1] < curve[0] / 10
    # the slower of the noise decay q and noiseless DiaDSP's contraction sets the rate (the long benchmark: 0.990)
    assert rate == pytest.approx(max(variant.q, bench.diadsp_contraction(A, variant.alpha)), abs=0.006)


# ---- checkpoint of the node state --------------------------------------------------------------------------------
def test_the_node_state_round_trips_and_the_run_continues_identically():
    H, b = quadratic_problem(6)
    x0 = torch.rand(N, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    topology = build_topology(nx.Graph(EDGES), N, weights="metropolis")
    make = dict(topology=topology, compressor=TopK(0.4), consensus_step=0.3, noise_x=0.3, noise_y=0.2,
                noise_decay=0.8, noise_seed=3, seed=3)

    def advance(node, steps):
        for _ in range(steps):
            node.step(node.x - 0.05 * node.track(H[node.rank] @ node.x - b[node.rank]))

    def straight(rank, exchange):
        node = CPGTGossip(x0[rank], rank=rank, exchange=exchange, **make)
        advance(node, 4)
        state = node.state_dict()
        advance(node, 5)
        return state, node.x

    def resumed(rank, exchange):
        node = CPGTGossip(torch.zeros(D, dtype=torch.float64), rank=rank, exchange=exchange, **make)
        node.load_state_dict(states[rank])
        advance(node, 5)
        return node

    first = LoopbackNetwork(N).run(straight)
    states = [s for s, _ in first]
    assert states[0]["round"] == 4 and set(states[0]["x_copies"]) == {0, 1, 2, 3}  # node 0: self + 3 neighbours
    second = LoopbackNetwork(N).run(resumed)
    for (_, x), node in zip(first, second):
        torch.testing.assert_close(node.x, x, rtol=0, atol=0)
        assert node.round == 9 and node.exchange.traffic.rounds == 9
    # without a noise seed the generator (its seed is the noise) is never written to a checkpoint
    unseeded = LoopbackNetwork(N).run(
        lambda rank, ex: CPGTGossip(x0[rank], rank=rank, exchange=ex, **{**make, "noise_seed": None}).state_dict()
    )
    assert "generator" not in unseeded[0] and "generator" in states[0]


# ---- the strategy's arguments ------------------------------------------------------------------------------------
def test_strategy_is_registered_and_refuses_bad_arguments_before_training():
    assert PRIVATE_STRATEGIES["cpgt"] is CPGTStrategy
    ok = dict(noise_decay=0.5, lipschitz=0.1, max_grad_norm=1.0, noise_x=0.1, noise_y=0.1)
    CPGTStrategy(**ok)
    for bad, message in [
        (dict(noise_multiplier=1.0), "noise_multiplier must be None or 0"),
        (dict(noise_x=None), "give both noise_x and noise_y"),
        (dict(noise_x=None, noise_y=None), "pass noise_x=... and noise_y=..., or target_epsilon"),
        (dict(noise_decay=1.0), "noise_decay (q) must be 'auto' or lie in (0, 1)"),
        (dict(lipschitz=0), "lipschitz (L, the smoothness constant"),
        (dict(accounting="rdp"), "accounting must be one of"),
    ]:
        with pytest.raises(PrivacyConfigError) as info:
            CPGTStrategy(**{**ok, **bad})
        assert message in str(info.value)
    with pytest.raises(TopologyError, match="directed"):
        CPGTStrategy(topology=build_topology("exponential", 4), **ok)


def test_only_plain_sgd_is_accepted_and_its_learning_rate_is_alpha():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    assert plain_sgd_step_size(torch.optim.SGD(params, lr=0.3)) == 0.3
    for optimizer in [
        torch.optim.SGD(params, lr=0.3, momentum=0.9),
        torch.optim.SGD(params, lr=0.3, weight_decay=1e-4),
        torch.optim.Adam(params, lr=0.3),
    ]:
        with pytest.raises(PrivacyConfigError, match="needs plain SGD whose learning rate is alpha"):
            plain_sgd_step_size(optimizer)
    two_rates = torch.optim.SGD([{"params": params[:1], "lr": 0.1}, {"params": params[1:], "lr": 0.2}])
    with pytest.raises(PrivacyConfigError, match="one step size alpha"):
        plain_sgd_step_size(two_rates)


def test_cpgt_refuses_a_step_size_outside_theorem_2_at_setup(tmp_path):
    """The user's SGD learning rate is CPGT's alpha: one outside Theorem 2 stops fit before the first step."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from tests.small_classifier import Classifier, dataset

    class TooLargeStep(Classifier):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=10.0)

    strategy = CPGTStrategy(topology="complete", max_grad_norm=1.0, noise_seed=3, noise_x=0.01, noise_y=0.01,
                            noise_decay=0.5, lipschitz=0.1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    with pytest.raises(PrivacyConfigError) as failure:
        trainer.fit(TooLargeStep(), DataLoader(dataset(64), batch_size=64))
    assert "CPGT Theorem 2 needs alpha < 1/(2L): alpha = 10 and L = 0.1 give alpha L = 1 >= 0.5" in str(failure.value)
    assert "Use a step size alpha (the SGD learning rate) below 5" in str(failure.value)
    assert trainer.global_step == 0


def test_qsgd_2_bits_is_the_papers_biased_quantizer_c2():
    """C2(x) = ||x|| / xi * sign(x) * 2^-(b-1) * floor(2^(b-1) |x| / ||x|| + u), xi = 1 + min(d / 2^(2(b-1)),
    sqrt(d) / 2^(b-1)), u ~ U[0, 1]^d; C2(0) = 0."""
    from lightning_privdec.compression.quantizers import _uniform

    b, d, key = 2, 10, 1234
    x = torch.randn(d, generator=torch.Generator().manual_seed(0))
    u = _uniform(d, key, torch.device("cpu"), torch.float32)  # the quantizer's dithering, U[0, 1)^d from the key
    assert u.shape == (d,) and 0 <= float(u.min()) and float(u.max()) < 1
    xi = 1 + min(d / 2 ** (2 * (b - 1)), math.sqrt(d) / 2 ** (b - 1))
    paper = x.norm() / xi * torch.sign(x) * 2.0 ** -(b - 1) * torch.floor(2 ** (b - 1) * x.abs() / x.norm() + u)
    torch.testing.assert_close(QSGD(b).compress(x, key), paper, rtol=1e-6, atol=1e-7)
    assert QSGD(b).tau(d) == xi
    assert torch.equal(QSGD(b).compress(torch.zeros(d), key), torch.zeros(d))


# ---- privdec-account cpgt ----------------------------------------------------------------------------------------
def test_cli_prints_epsilon_as_json_and_exits_2_on_a_violated_condition(capsys):
    import json

    from lightning_privdec.cli.account import main

    args = ["cpgt", "--alpha", "0.1", "--lipschitz", "2", "--q", "0.9", "--noise-x", "2", "--noise-y", "4",
            "--sensitivity", "0.5"]
    assert main([*args, "--json"]) == 0  # the console script itself is launched once, in tests/test_cli.py
    record = json.loads(capsys.readouterr().out)
    common = dict(alpha=0.1, lipschitz=2.0, q=0.9, noise_x=2.0, noise_y=4.0, sensitivity=0.5)
    assert record["epsilon"] == pytest.approx(cpgt_epsilon(**common), rel=1e-12)  # l1 quantities: no sqrt(d)
    assert record["epsilon_theorem2"] == pytest.approx(theorem2_epsilon(**common), rel=1e-12)
    assert record["delta"] == 0.0
    assert main([*args, "--dimension", "16", "--steps", "30", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["epsilon"] == pytest.approx(4 * cpgt_epsilon(**common), rel=1e-12)
    assert record["epsilon_finite"] == pytest.approx(
        cpgt_epsilon_after(30, **common, norm_factor=4.0, linear_difference=False), rel=1e-12)
    assert main([*args[:-2], "--sensitivity", "0.5", "--alpha", "0.3"]) == 2
    assert "alpha < 1/(2L): alpha = 0.3 and L = 2 give alpha L = 0.6 >= 0.5" in capsys.readouterr().err
    assert main([a if a != "0.9" else "0.5" for a in args]) == 2
    assert "q (noise_decay) between 0.5583 and 1" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:noise_multiplier=0 adds no noise")  # a bare node: CPGT's noise is Laplace
def test_cli_without_q_chooses_it_as_the_strategys_auto_does_and_says_so(capsys):
    import json

    from lightning_privdec.cli.account import main
    from tests.test_write_ahead_ledger import make_cpgt_node  # alpha = 0.1, d = 3

    args = ["cpgt", "--alpha", "0.1", "--lipschitz", "2", "--noise-x", "2", "--noise-y", "4", "--sensitivity", "0.5"]
    assert main([*args, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    q = make_cpgt_node(noise_decay="auto", lipschitz=2.0, noise_x=2.0, noise_y=4.0).noise_decay
    assert record["q"] == q and record["q_auto"] is True and min_noise_decay(0.1, 2.0) < q < 1
    assert record["epsilon"] == pytest.approx(
        cpgt_epsilon(alpha=0.1, lipschitz=2.0, q=q, noise_x=2.0, noise_y=4.0, sensitivity=0.5), rel=1e-12)
    assert main(args) == 0
    assert f"q = {q:g} (chosen automatically, as noise_decay='auto')" in capsys.readouterr().out
    assert main([*args, "--q", "0.9", "--json"]) == 0  # given: used as is, and said so
    assert json.loads(capsys.readouterr().out)["q_auto"] is False
    assert main([*args, "--q", "0.9"]) == 0 and "automatically" not in capsys.readouterr().out
    # no q to choose (alpha L >= 1/2): exit code 2 with the strategy's own message
    with pytest.raises(PrivacyConfigError) as refused:
        make_cpgt_node(noise_decay="auto", lipschitz=6.0, noise_x=2.0, noise_y=4.0)
    assert main([*args, "--lipschitz", "6"]) == 2  # the last --lipschitz counts
    assert str(refused.value) in capsys.readouterr().err
    assert "alpha < 1/(2L): alpha = 0.1 and L = 6 give alpha L = 0.6 >= 0.5" in str(refused.value)


@pytest.mark.parametrize("accounting", ["sound", "theorem2", "finite"])
def test_whole_run_accountings_refuse_mini_batches_and_a_batch_above_the_shard_means_q_equal_one(accounting):
    """Assumption 4 (a constant gradient difference) fails when the example is sampled in some steps and not others:
    the privacy audit measured epsilon >= 4.6 against a claimed 2 at q = 0.1 (docs/audit.md)."""
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_write_ahead_ledger import make_cpgt_node

    def dp():
        return make_cpgt_node(noise_x=1.0, noise_y=1.0, accounting=accounting)

    data = TensorDataset(torch.randn(50, 3), torch.randn(50))
    full = dp()
    full.private_dataloader(DataLoader(data, batch_size=64), planned_steps=10)
    assert full.sample_rate == 1.0 and full.expected_batch_size == 50
    mini = DataLoader(data, batch_size=5)
    if accounting == "finite":
        assert dp().private_dataloader(mini, planned_steps=10) is not None
    else:
        with pytest.raises(PrivacyConfigError, match="needs full batches .* sample 5 of its 50 examples per step"):
            dp().private_dataloader(mini, planned_steps=10)


# ---- defaults: noise_decay="auto", lipschitz required ------------------------------------------------------------
def test_lipschitz_has_no_default_its_absence_is_a_clear_error_and_noise_decay_defaults_to_auto():
    """L is the user's assumption (Theorem 2 rests on it): without it the strategy says so, not a TypeError."""
    with pytest.raises(PrivacyConfigError, match=r"assumes every node's clipped loss gradient is L-smooth.*Pass "
                                                 r"lipschitz=L"):
        CPGTStrategy(max_grad_norm=1.0, target_epsilon=3.0)
    strategy = CPGTStrategy(max_grad_norm=1.0, target_epsilon=3.0, lipschitz=0.1)
    assert strategy.options.noise_decay == "auto" and strategy.options.lipschitz == 0.1
    with pytest.raises(PrivacyConfigError, match=r"must be 'auto' or lie in \(0, 1\)"):
        CPGTStrategy(max_grad_norm=1.0, target_epsilon=3.0, lipschitz=0.1, noise_decay="fast")


@pytest.mark.parametrize("alpha, L, ratio", [(0.5, 0.1, 1.0), (0.1, 2.5, 1.0), (0.01, 1.0, 1.0), (0.5, 0.1, 10.0)])
def test_auto_noise_decay_minimises_epsilon_times_the_fixed_point_offset_inside_theorem2s_interval(alpha, L, ratio):
    """q* = argmin over Theorem 2's interval of epsilon(q) x std(sum_k eta_y(k)) (Remark 2), found on a fine grid."""
    from lightning_privdec.privacy.accounting.cpgt import auto_noise_decay

    def product(q: float) -> float:
        epsilon = cpgt_epsilon(alpha=alpha, lipschitz=L, q=q, noise_x=ratio, noise_y=1.0, sensitivity=1.0)
        return epsilon * math.sqrt(2.0 / (1.0 - q * q))  # the y-noise the tracker keeps, per coordinate (d_y = 1)

    low = min_noise_decay(alpha, L)
    grid = np.linspace(low, 1.0, 20001)[1:-1]
    best = grid[int(np.argmin([product(q) for q in grid]))]
    q = auto_noise_decay(alpha, L, noise_x=ratio, noise_y=1.0)
    assert low < q < 1.0 and q == pytest.approx(best, abs=2 * (1.0 - low) / 20000)
    check_theorem2(alpha, L, q)
    with pytest.raises(PrivacyConfigError, match="alpha < 1/\\(2L\\)"):
        auto_noise_decay(0.5, 1.0)


def test_the_node_chooses_q_once_alpha_is_known_and_the_gossip_decays_at_it():
    from lightning_privdec.privacy.accounting.cpgt import auto_noise_decay
    from tests.test_write_ahead_ledger import make_cpgt_node

    node = make_cpgt_node(noise_decay="auto", target_epsilon=3.0)  # alpha = 0.1, L = 1
    assert node.noise_decay == pytest.approx(auto_noise_decay(0.1, 1.0)) and node.noise_decay != 0.9
    calibrated = make_cpgt_node(noise_decay="auto", noise_x=2.0, noise_y=1.0)
    assert calibrated.noise_decay == pytest.approx(auto_noise_decay(0.1, 1.0, noise_x=2.0, noise_y=1.0))
    with pytest.raises(PrivacyConfigError, match="noise_decay='auto' picks q in Theorem 2's interval"):
        make_cpgt_node(noise_decay="auto", noise_x=1.0, noise_y=1.0, accounting="finite", lipschitz=10.0)


def test_the_digits_quick_start_states_cpgts_lipschitz_assumption_and_trains_it_on_full_batches():
    digits = load_script(ROOT / "examples" / "digits.py", "digits_example_cpgt")
    args = digits.parse_args(["--strategy", "cpgt", "--epsilon", "3"])
    strategy = digits.build_strategy(args)
    assert strategy.options.lipschitz == digits.CPGT_ASSUMED_LIPSCHITZ and strategy.options.noise_decay == "auto"
    lr, epochs, batch_size = digits.training_defaults(args)
    assert batch_size == 1.0 and epochs == 100 and lr * digits.CPGT_ASSUMED_LIPSCHITZ < 0.5  # full batches
    override = digits.parse_args(["--strategy", "cpgt", "--strategy-kwargs", '{"lipschitz": 0.3}'])
    assert digits.build_strategy(override).options.lipschitz == 0.3


def test_tracker_noise_offset_is_the_norm_of_the_mean_accumulated_y_noise_and_the_strategy_refuses_above_C(monkeypatch):
    """Remark 2: the trackers keep sum_k eta_y(k); its network mean has norm ~ d_y sqrt(2 d / ((1 - q^2) n))."""
    from types import SimpleNamespace

    from lightning_privdec.privacy.accounting.cpgt import tracker_noise_offset

    d_y, q, d, n, rounds = 0.3, 0.7, 400, 4, 60
    gen = node_noise_generator(torch.device("cpu"), 0, 0, stream="test-offset")
    total = sum(laplace_noise(d * n, d_y * q**k, gen).reshape(n, d) for k in range(rounds))
    assert float(total.mean(0).norm()) == pytest.approx(tracker_noise_offset(d_y, q, d, n), rel=0.1)

    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    strategy = CPGTStrategy(lipschitz=0.25, max_grad_norm=1.0, target_epsilon=3.0)
    monkeypatch.setattr(CPGTStrategy, "world_size", property(lambda self: 4))
    monkeypatch.setattr(rank_zero_only, "rank", 0)  # another test's Trainer may have left a rank behind
    dp = SimpleNamespace(noise_y=0.3677, noise_decay=0.7595, dimension=4810)  # the digits quick start at eps 3
    with pytest.raises(PrivacyConfigError, match=r"expected norm 27.7 .* no fixed point, .* raise target_epsilon to about 83"):
        strategy._warn_about_the_tracker_noise(dp)  # calibrated from the budget alone: refused
    by_hand = CPGTStrategy(lipschitz=0.25, max_grad_norm=1.0, noise_x=0.3677, noise_y=0.3677, noise_decay=0.7595)
    with pytest.warns(UserWarning, match=r"no fixed point, .* lower noise_y to about 0.0133"):
        by_hand._warn_about_the_tracker_noise(dp)  # noise set by hand: the user is warned
    dp.noise_y = 0.3677 / 40  # epsilon 120: offset 0.69 C, trains (no warning)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._warn_about_the_tracker_noise(dp)


