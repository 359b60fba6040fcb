"""Run one private strategy on n simulated nodes with gradient canaries on node 0, and audit node 0's messages.

The run uses the library's own pieces, so whatever they do wrong the audit sees: each strategy object builds its
node algorithm (``make_node_algorithm``: Poisson sampling, per-sample clipping, noise, accountant, gossip), and
:func:`~lightning_privdec.algorithms.simulation.train_node` runs the strategies' own node step on it
(:class:`~lightning_privdec.algorithms.node.NodeRunner`: forward and backward on the Poisson batch, the release
privatized and recorded, the SGD update of the numerator, the gossip round) over a
:class:`~lightning_privdec.comm.LoopbackNetwork`. Only Lightning's loop around that step is left out.

Node 0's shard holds ordinary examples plus each of m Dirac canaries with probability 1/2
(:mod:`~lightning_privdec.audit.canaries`). The auditor reads every message on the wire
(:mod:`~lightning_privdec.audit.observer`), scores each canary by the matched filter of its coordinate in what the
node released, and turns its guesses into the one-run lower bound (:mod:`~lightning_privdec.audit.one_run`).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import networkx as nx
import numpy as np
import torch
from torch.utils.data import DataLoader

from lightning_privdec.audit.canaries import AuditModel, CanaryDesign, audit_loss, node_dataset
from lightning_privdec.audit.observer import WireTap, cpgt_observations, push_sum_released
from lightning_privdec.audit.one_run import score_audit
from lightning_privdec.comm import LoopbackNetwork
from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.privacy.pairwise import simulate_key_agreement
from lightning_privdec.strategies.offline import offline_node, offline_strategy, train_offline

__all__ = ["AUDITED_STRATEGIES", "BREAKABLE", "BREAKS", "AuditReport", "run_audit"]

#: each strategy's audit setting: its default graph and compressor (CPGT: L = 1 holds for the audit's least squares)
AUDITED_STRATEGIES: dict[str, dict[str, Any]] = {
    "dp_csgp": {"topology": "exponential", "compressor": "randk:0.5"},
    "privsgp": {"topology": "exponential"},
    "dp2sgd": {"topology": "ring"},
    "dyn_d2p": {"topology": "exponential-one-peer", "rho_c": 2.0, "rho_mu": 2.0},
    "privsgp_vr": {"topology": "exponential-one-peer"},
    "cpgt": {"topology": "ring", "noise_decay": 0.9, "lipschitz": 1.0},
    "decor": {"topology": "ring", "adversary": "eavesdropper"},
}

#: deliberately broken configurations: "noise" switches the noise off, "clipping" raises C 1000-fold at the same noise
#: std (canaries unclipped)
BREAKS = ("noise", "clipping")
#: the strategies whose noise can be given explicitly (Dyn-D2P derives it from the budget): the strategy arguments that
#: set it, each also the node attribute that holds the level planned, and whether they are in units of the clip bound
#: C (else absolute stds)
BREAKABLE: dict[str, tuple[tuple[str, ...], bool]] = {
    "dp_csgp": (("noise_multiplier",), True),
    "privsgp": (("noise_multiplier",), True),
    "dp2sgd": (("noise_multiplier",), True),
    "privsgp_vr": (("noise_multiplier",), True),
    "decor": (("sigma_cdp", "sigma_cor"), False),
    "cpgt": (("noise_x", "noise_y"), False),
}
CLIP_BREAK_FACTOR = 1000.0
#: Decor and CPGT refuse a zero noise scale: "noise" scales theirs by this factor instead
NOISE_BREAK_FACTOR = 1e-9


@dataclass
class AuditReport:
    """One audit: the accountant's epsilon next to the empirical lower bound, and how the bound was obtained."""

    strategy: str
    broken: str | None
    claimed_epsilon: float  # the accountant's epsilon of node 0 (for a broken run: of the nominal configuration)
    delta: float
    lower_bound: float  # empirical epsilon lower bound at `confidence`
    confidence: float
    canaries: int  # m
    included: int  # canaries in node 0's shard
    guesses: int  # r
    correct: int  # v
    steps: int
    nodes: int
    sample_rate: float  # node 0's Poisson rate q = B / J
    observer: str
    noise: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def consistent(self) -> bool:
        """Whether the lower bound stays within the claimed epsilon (what a correct mechanism guarantees)."""
        return self.lower_bound <= self.claimed_epsilon

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "consistent": self.consistent}


def _planned_epsilon(node: PrivateNodeAlgorithm, steps: int) -> float:
    """The accountant's epsilon of ``steps`` steps of the node's planned release (nothing recorded)."""
    release = node.next_release()
    assert release is not None
    return node.ledger.epsilon_after(steps, release)


def _broken_configuration(
    name: str, kwargs: Mapping[str, Any], broken: str, nodes: int, loader: DataLoader, steps: int, dimension: int,
    lr: float,
) -> tuple[dict[str, Any], float]:
    """The broken run's strategy arguments, and the epsilon the accountant claims for the honest configuration."""
    node = offline_node(offline_strategy(name, 0, nodes, **kwargs))
    model = AuditModel(dimension)
    node.attach(model)
    node.configure_optimizer(torch.optim.SGD(model.parameters(), lr=lr), dimension)
    node.private_dataloader(loader, steps, nodes, node_local_data=True)  # plans the honest noise
    claimed = _planned_epsilon(node, steps)
    arguments, relative_to_clip = BREAKABLE[name]
    planned = {k: float(getattr(node, k)) for k in arguments}  # the calibrated levels, as if passed by hand
    update: dict[str, Any] = {"target_epsilon": None, **planned}
    if broken == "clipping":  # C raised, the noise std unchanged
        update["max_grad_norm"] = float(kwargs["max_grad_norm"]) * CLIP_BREAK_FACTOR
        if relative_to_clip:
            update.update({k: v / CLIP_BREAK_FACTOR for k, v in planned.items()})
    elif relative_to_clip:  # no noise at all
        update.update({k: 0.0 for k in planned})
    else:  # absolute scales that must stay positive: a billionth of the honest ones
        update.update({k: v * NOISE_BREAK_FACTOR for k, v in planned.items()})
    return update, claimed


def _node(
    rank: int, exchange: Any, strategy: Any, node: PrivateNodeAlgorithm, dataset: Any, batch_size: int, *,
    dimension: int, steps: int, lr: float,
) -> list[dict[int, list[torch.Tensor]]]:
    """One simulated node: the strategies' private step, ``steps`` times, on its Poisson batches; what it sent."""
    tap = WireTap(exchange)
    train_offline(strategy, node, AuditModel(dimension), dataset, exchange=tap, batch_size=batch_size, steps=steps,
                  lr=lr, loss=audit_loss)
    return tap.sent


def _decor_weights(decor: Any, graph: nx.Graph, node: int) -> np.ndarray:
    """Sigma^{-1} e_node: the eavesdropper's generalised least squares over all nodes' releases of one coordinate.

    Node k adds vbar_k + sum_{l in N_k} v_kl with v_kl = -v_lk, so the noise across nodes has covariance
    sigma_cdp^2 I + sigma_cor^2 L (L the graph Laplacian); the canary moves only node ``node``'s release.
    """
    laplacian = nx.laplacian_matrix(graph, nodelist=sorted(graph.nodes)).toarray()
    covariance = decor.sigma_cdp**2 * np.eye(len(laplacian)) + decor.sigma_cor**2 * laplacian
    return np.linalg.solve(covariance, np.eye(len(laplacian))[node])


#: warnings of the library and Opacus that say nothing about the audit (a broken run's own noise_multiplier=0, Opacus's
#: per-sample hooks on a model whose inputs need no gradient, the RDP order grid of a tiny noise multiplier)
_QUIET = ("noise_multiplier=0 adds no noise", "Full backward hook is firing", "Optimal order is the")


def _quiet(function: Callable[..., AuditReport]) -> Callable[..., AuditReport]:
    """``function`` with the warnings of :data:`_QUIET` silenced while it runs."""

    @functools.wraps(function)
    def quiet(*args: Any, **kwargs: Any) -> AuditReport:
        with warnings.catch_warnings():
            for message in _QUIET:
                warnings.filterwarnings("ignore", message=message)
            return function(*args, **kwargs)

    return quiet


@_quiet
def run_audit(
    strategy: str,
    *,
    epsilon: float = 2.0,
    delta: float = 1e-5,
    canaries: int = 1000,
    nodes: int = 4,
    steps: int = 100,
    sample_rate: float | None = None,
    lr: float = 0.1,
    clip: float = 1.0,
    canary_norm: float = 500.0,
    examples: int = 200,
    broken: str | None = None,
    confidence: float = 0.95,
    seed: int = 0,
    guess_counts: Sequence[int] | None = None,
    strategy_kwargs: Mapping[str, Any] | None = None,
) -> AuditReport:
    """Audit node 0 of ``strategy`` with m canaries; see the module docstring and docs/audit.md.

    Args:
        strategy: a private strategy name (``dp_csgp``, ``privsgp``, ``dp2sgd``, ``dyn_d2p``, ``privsgp_vr``,
            ``cpgt``, ``decor``).
        epsilon, delta: the target the strategy calibrates its noise to (CPGT: pure epsilon, delta = 0).
        canaries: m; node 0 holds each with probability 1/2.
        nodes, steps: the simulated network and the number of rounds (the plan the noise is calibrated for).
        sample_rate: sets the batch size B = q (examples + m/2) of every node, so node 0 samples at about q = B / J
            (default 0.1; CPGT 1.0, full gradients: its epsilon assumes them).
        lr: SGD step size (CPGT's alpha). clip: C. canary_norm: the canaries' gradient norm (>= C; honest clipping
            scales it to C, a run that skips clipping releases all of it).
        examples: ordinary examples on node 0 (the other nodes hold examples + m/2: node 0's shard on average).
        broken: ``None``, ``"noise"`` (noise switched off: noise_multiplier = 0; Decor and CPGT, which refuse 0,
            scale theirs by 1e-9) or ``"clipping"`` (C raised 1000-fold at the same noise std: canaries pass
            unclipped); the claimed epsilon is then the honest configuration's. Not for Dyn-D2P (its noise comes from
            the budget).
        confidence: of the lower bound (default 95%).
        seed: canary inclusions, data, noise and sampling streams (the auditor never reads the noise).
        guess_counts: the numbers of guesses r to try (Bonferroni-corrected); default 2% ... 100% of m.
        strategy_kwargs: extra strategy arguments, overriding the audit's defaults.
    """
    if strategy not in AUDITED_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(AUDITED_STRATEGIES)}")
    if broken is not None and broken not in BREAKS:
        raise ValueError(f"broken must be None or one of {', '.join(map(repr, BREAKS))}, got {broken!r}")
    if broken is not None and strategy not in BREAKABLE:
        raise ValueError(
            f"a broken configuration needs noise levels given explicitly, and {strategy} derives its own from the "
            f"budget; use one of {', '.join(BREAKABLE)}"
        )
    if nodes < 2 or steps < 2:
        raise ValueError(f"the audit needs nodes >= 2 and steps >= 2, got nodes={nodes}, steps={steps}")
    if not clip <= canary_norm < clip * CLIP_BREAK_FACTOR:
        raise ValueError(
            f"canary_norm={canary_norm} must lie in [clip, {CLIP_BREAK_FACTOR:g} clip) = [{clip}, "
            f"{clip * CLIP_BREAK_FACTOR:g}): the canaries must reach the clip bound, and pass a broken one unclipped"
        )
    started = time.perf_counter()
    is_cpgt = strategy == "cpgt"
    q = (1.0 if is_cpgt else 0.1) if sample_rate is None else float(sample_rate)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1], got {q}")
    design = CanaryDesign(canaries, examples=examples, norm=canary_norm, seed=seed)
    included = design.inclusions()
    # Every other shard as large as node 0's on average, and one batch size B for all: nothing outside node 0's own
    # mechanism depends on which canaries it holds (full batches, q = 1, take the whole shard).
    expected_shard = examples + canaries // 2
    datasets = [node_dataset(design, 0, included)]
    datasets += [node_dataset(design, k, None, expected_shard) for k in range(1, nodes)]
    batches = [len(ds) if q == 1.0 else max(1, round(q * expected_shard)) for ds in datasets]

    kwargs: dict[str, Any] = dict(AUDITED_STRATEGIES[strategy])
    kwargs.update(max_grad_norm=clip, target_epsilon=epsilon, seed=seed, noise_seed=seed)
    if not is_cpgt:
        kwargs["target_delta"] = delta
    kwargs.update(strategy_kwargs or {})
    claimed: float | None = None
    if broken is not None:
        update, claimed = _broken_configuration(strategy, kwargs, broken, nodes,
                                                DataLoader(datasets[0], batch_size=batches[0]), steps,
                                                design.dimension, lr)
        kwargs.update(update)

    strategies = [offline_strategy(strategy, k, nodes, **kwargs) for k in range(nodes)]
    if getattr(strategies[0], "staleness", 0):
        raise ValueError("the auditor follows gossip mixed in the round it is sent: audit with overlap=False")
    topology = strategies[0].topology
    secrets, graph = None, nx.Graph(topology.union_graph())
    if strategy == "decor":
        secrets = simulate_key_agreement({k: sorted(graph.neighbors(k)) for k in range(nodes)})
    algorithms = [offline_node(s, secrets) for s in strategies]
    network = LoopbackNetwork(nodes, timeout=600.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # n node threads on tiny tensors: intra-op parallelism only oversubscribes the cores
    try:
        transcripts = network.run(
            lambda rank, exchange: _node(rank, exchange, strategies[rank], algorithms[rank], datasets[rank],
                                         batches[rank], dimension=design.dimension, steps=steps, lr=lr)
        )
    finally:
        torch.set_num_threads(threads)

    algorithm = algorithms[0]
    coords = design.canary_coordinates
    common = dict(compressor=strategies[0].compressor, consensus_step=strategies[0].consensus_step,
                  seed=strategies[0].seed)  # the public message keys (strategy_kwargs may override the seed)
    noise: dict[str, Any] = {}
    if is_cpgt:
        o_y, o_x, innovations = cpgt_observations(transcripts, topology, 0, dimension=design.dimension, alpha=lr,
                                                  **common)
        d_x, d_y, decay = algorithm.noise_x, algorithm.noise_y, algorithm.noise_decay  # type: ignore[attr-defined]
        noise = {"noise_x": d_x, "noise_y": d_y, "noise_decay": decay}
        if algorithm.sample_rate == 1.0:  # full gradients: only round 0 depends on the canary (Assumption 4)
            scores = (o_y[coords] / d_y + o_x[coords] / (d_x * decay / lr)).numpy()
            observer = "every message; node 0's first tracker and state messages, inverse-scale weights"
        else:  # mini-batches: each sampling of a canary moves g_k - g_(k-1), seen under noise d_y q^k
            scales = d_y * decay ** torch.arange(len(innovations), dtype=torch.float64)
            scores = (innovations[:, coords].abs() / scales[:, None]).amax(0).numpy()
            observer = "every message; node 0's tracker innovations, max over rounds of |innovation| / noise scale"
    else:
        released = push_sum_released(transcripts, topology, x0=torch.zeros(design.dimension), lr=lr, **common)
        # in the units of the clipped sum (times each node's public expected batch size qJ), where the noise lives
        batch = np.array([e.expected_batch_size for e in algorithms])
        canary_releases = released[:, :, coords].numpy() * batch[:, None, None]  # (nodes, rounds, m)
        if strategy == "decor":
            weights = _decor_weights(algorithm, graph, 0)
            scores = np.einsum("k,ktm->m", weights, canary_releases)
            observer = "every message of every node (eavesdropper); generalised least squares across nodes"
            noise = {"sigma_cdp": algorithm.sigma_cdp, "sigma_cor": algorithm.sigma_cor,
                     "adversary": algorithm.adversary}
        elif strategy == "dyn_d2p":
            schedule = algorithm.schedule
            assert schedule is not None
            weights = np.array([1.0 / (schedule.noise_multiplier(t) ** 2 * schedule.clip(t)) for t in range(steps)])
            scores = np.einsum("t,tm->m", weights, canary_releases[0])
            observer = "every message; node 0's released gradients, step t weighted by C_t / (sigma_t C_t)^2"
            noise = {"sigma_first": schedule.noise_multiplier(0), "sigma_last": schedule.noise_multiplier(steps - 1),
                     "clip_first": schedule.clip(0), "clip_last": schedule.clip(steps - 1)}
        else:
            scores = canary_releases[0].sum(0)
            observer = "every message; node 0's released gradients summed over the rounds"
            noise = {"noise_multiplier": algorithm.noise_multiplier,
                     "max_grad_norm": algorithm.parameters.max_grad_norm}
            if strategy == "privsgp_vr":
                noise["split"] = algorithm.split
    outcome = score_audit(scores, included, delta=algorithm.delta, confidence=confidence, guess_counts=guess_counts,
                          seed=seed)
    return AuditReport(
        strategy=strategy,
        broken=broken,
        claimed_epsilon=float(algorithm.epsilon()) if claimed is None else claimed,
        delta=float(algorithm.delta),
        lower_bound=outcome.epsilon,
        confidence=confidence,
        canaries=canaries,
        included=int(included.sum()),
        guesses=outcome.guesses,
        correct=outcome.correct,
        steps=steps,
        nodes=nodes,
        sample_rate=float(algorithm.sample_rate),  # type: ignore[arg-type]
        observer=observer,
        noise=noise,
        seconds=time.perf_counter() - started,
    )
