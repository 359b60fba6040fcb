"""Run one private strategy on n simulated nodes with gradient canaries on node 0, and audit node 0's messages.

The run uses the library's own pieces, so whatever they do wrong the audit sees: the strategy object builds its
privacy engine (Poisson sampling, per-sample clipping through Opacus's hooks, noise, accountant) and its gossip;
each simulated node then repeats the step of :meth:`DecentralizedStrategy.optimizer_step` (forward and backward on
the Poisson batch, the strategy's ``transform_gradients``, the SGD update of the numerator, the gossip round) over a
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
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.utils.data import DataLoader

from lightning_privdec.audit.canaries import AuditModel, CanaryDesign, audit_loss, node_dataset
from lightning_privdec.audit.observer import WireTap, cpgt_observations, push_sum_released
from lightning_privdec.audit.one_run import score_audit
from lightning_privdec.comm import LoopbackNetwork
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.algorithms.cpgt_node import CPGTPrivacyEngine
from lightning_privdec.algorithms.decor import DecorNode
from lightning_privdec.algorithms.dyn_d2p import DynD2PNode
from lightning_privdec.privacy.pairwise import simulate_key_agreement
from lightning_privdec.algorithms.privsgp_vr import PrivSGPVRNode
from lightning_privdec.strategies import PRIVATE_STRATEGIES, CorrelatedNoiseStrategy, FlatParameters
from lightning_privdec.strategies.cpgt import CPGTStrategy

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

#: deliberately broken configurations (strategies whose noise can be given explicitly; Dyn-D2P derives it from the
#: budget): "noise" switches the noise off, "clipping" raises C 1000-fold at the same noise std (canaries unclipped)
BREAKS = ("noise", "clipping")
BREAKABLE = ("dp_csgp", "privsgp", "dp2sgd", "privsgp_vr", "decor", "cpgt")
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


def _environment(rank: int, world_size: int) -> LightningEnvironment:
    environment = LightningEnvironment()
    environment.set_global_rank(rank)
    environment.set_world_size(world_size)
    return environment


def _make_strategy(name: str, rank: int, nodes: int, kwargs: Mapping[str, Any]) -> Any:
    strategy = PRIVATE_STRATEGIES[name](
        **kwargs, parallel_devices=[torch.device("cpu")], cluster_environment=_environment(rank, nodes)
    )
    strategy.topology = strategy._build_topology(nodes)
    return strategy


def _make_engine(strategy: Any, secrets: Mapping[int, Any] | None, rank: int) -> DPCSGPNode:
    """The strategy's own engine; Decor's pairwise keys are agreed in memory instead of over torch.distributed."""
    if not isinstance(strategy, CorrelatedNoiseStrategy):
        return strategy.make_privacy_engine()
    engine = strategy.new_engine()
    if secrets is not None:  # planning alone needs no secrets
        engine.secrets = secrets[rank]
    return engine


def _planned_epsilon(engine: DPCSGPNode, steps: int) -> float:
    """The accountant's epsilon of ``steps`` steps at the engine's planned noise and rate (nothing recorded)."""
    if isinstance(engine, (PrivSGPVRNode, DecorNode)):
        return engine.ledger.epsilon_after(steps, *engine.next_release())
    if isinstance(engine, CPGTPrivacyEngine):
        return engine._epsilon_after(steps)
    return engine.ledger.epsilon_if(engine.noise_multiplier, engine.sample_rate, steps)


def _broken_configuration(
    name: str, kwargs: Mapping[str, Any], broken: str, nodes: int, loader: DataLoader, steps: int, dimension: int,
    lr: float,
) -> tuple[dict[str, Any], float]:
    """The broken run's strategy arguments, and the epsilon the accountant claims for the honest configuration."""
    engine = _make_engine(_make_strategy(name, 0, nodes, kwargs), None, 0)
    engine.attach(AuditModel(dimension))
    if isinstance(engine, CPGTPrivacyEngine):
        engine.configure(step_size=lr, dimension=dimension)
    engine.private_dataloader(loader, steps, nodes, node_local_data=True)  # plans the honest noise
    claimed = _planned_epsilon(engine, steps)
    clip = float(kwargs["max_grad_norm"])
    update: dict[str, Any] = {"target_epsilon": None}
    if broken == "clipping":
        update["max_grad_norm"] = clip * CLIP_BREAK_FACTOR
    if isinstance(engine, DecorNode):  # absolute noise stds on the clipped sum
        off = broken == "noise"
        update.update(sigma_cdp=engine.sigma_cdp * (NOISE_BREAK_FACTOR if off else 1.0),
                      sigma_cor=0.0 if off else engine.sigma_cor)
    elif isinstance(engine, CPGTPrivacyEngine):  # absolute Laplace scales
        factor = NOISE_BREAK_FACTOR if broken == "noise" else 1.0
        update.update(noise_x=engine.noise_x * factor, noise_y=engine.noise_y * factor)
    else:  # sigma in units of C
        sigma = float(engine.noise_multiplier)  # type: ignore[arg-type]
        update["noise_multiplier"] = 0.0 if broken == "noise" else sigma / CLIP_BREAK_FACTOR
    return update, claimed


def _node(
    rank: int, exchange: Any, strategy: Any, engine: DPCSGPNode, dataset: Any, batch_size: int, *,
    dimension: int, steps: int, lr: float,
) -> list[dict[int, list[torch.Tensor]]]:
    """One simulated node: DecentralizedStrategy.optimizer_step, ``steps`` times, on its Poisson batches."""
    model = AuditModel(dimension)
    engine.attach(model)
    flat = FlatParameters(model)
    tap = WireTap(exchange)
    strategy.privacy = engine
    gossip = strategy.build_gossip(flat.buffer, tap)
    optimizer = torch.optim.SGD(flat.parameters, lr=lr)
    strategy.gossip, strategy.flat = gossip, flat
    strategy.optimizers = [optimizer]
    if isinstance(strategy, CPGTStrategy):
        engine.configure(step_size=lr, dimension=flat.numel)  # type: ignore[attr-defined]
    loader = engine.private_dataloader(DataLoader(dataset, batch_size=batch_size), steps, exchange.world_size,
                                       node_local_data=True)
    if isinstance(strategy, CPGTStrategy):
        gossip.set_noise(engine.noise_x, engine.noise_y)  # type: ignore[attr-defined]

    def backward(batch: Sequence[torch.Tensor]) -> bool:
        x, y, canary = batch
        if len(x) == 0:
            return False  # an empty Poisson batch releases pure noise
        audit_loss(model(x), y, canary).mean().backward()
        return True

    if isinstance(engine, PrivSGPVRNode):
        engine.before_first_step(backward)  # PrivSGP-VR, Algorithm 1 lines 1-3
    taken = 0
    while taken < steps:
        for batch in loader:
            if taken == steps:
                break
            optimizer.zero_grad(set_to_none=True)
            backward(batch)
            strategy.transform_gradients()  # clip, noise (or track), record
            flat.buffer.copy_(gossip.x)  # the optimizer updates the numerator x
            optimizer.step()
            gossip.step(flat.buffer)
            gossip.debias_into(flat.buffer)
            taken += 1
    return tap.sent


def _decor_weights(engine: DecorNode, graph: nx.Graph, node: int) -> np.ndarray:
    """Sigma^{-1} e_node: the eavesdropper's generalised least squares over all nodes' releases of one coordinate.

    Node k adds vbar_k + sum_{l in N_k} v_kl with v_kl = -v_lk, so the noise across nodes has covariance
    sigma_cdp^2 I + sigma_cor^2 L (L the graph Laplacian); the canary moves only node ``node``'s release.
    """
    laplacian = nx.laplacian_matrix(graph, nodelist=sorted(graph.nodes)).toarray()
    covariance = engine.sigma_cdp**2 * np.eye(len(laplacian)) + engine.sigma_cor**2 * laplacian
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

    strategies = [_make_strategy(strategy, k, nodes, kwargs) for k in range(nodes)]
    if getattr(strategies[0], "staleness", 0):
        raise ValueError("the auditor follows gossip mixed in the round it is sent: audit with overlap=False")
    topology = strategies[0].topology
    secrets, graph = None, nx.Graph(topology.union_graph())
    if strategy == "decor":
        secrets = simulate_key_agreement({k: sorted(graph.neighbors(k)) for k in range(nodes)})
    engines = [_make_engine(s, secrets, k) for k, s in enumerate(strategies)]
    network = LoopbackNetwork(nodes, timeout=600.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # n node threads on tiny tensors: intra-op parallelism only oversubscribes the cores
    try:
        transcripts = network.run(
            lambda rank, exchange: _node(rank, exchange, strategies[rank], engines[rank], datasets[rank],
                                         batches[rank], dimension=design.dimension, steps=steps, lr=lr)
        )
    finally:
        torch.set_num_threads(threads)

    engine = engines[0]
    coords = design.canary_coordinates
    common = dict(compressor=strategies[0].compressor, consensus_step=strategies[0].consensus_step,
                  seed=strategies[0].seed)  # the public message keys (strategy_kwargs may override the seed)
    noise: dict[str, Any] = {}
    if is_cpgt:
        o_y, o_x, innovations = cpgt_observations(transcripts, topology, 0, dimension=design.dimension, alpha=lr,
                                                  **common)
        d_x, d_y, decay = engine.noise_x, engine.noise_y, engine.noise_decay  # type: ignore[attr-defined]
        noise = {"noise_x": d_x, "noise_y": d_y, "noise_decay": decay}
        if engine.sample_rate == 1.0:  # full gradients: only round 0 depends on the canary (Assumption 4)
            scores = (o_y[coords] / d_y + o_x[coords] / (d_x * decay / lr)).numpy()
            observer = "every message; node 0's first tracker and state messages, inverse-scale weights"
        else:  # mini-batches: each sampling of a canary moves g_k - g_(k-1), seen under noise d_y q^k
            scales = d_y * decay ** torch.arange(len(innovations), dtype=torch.float64)
            scores = (innovations[:, coords].abs() / scales[:, None]).amax(0).numpy()
            observer = "every message; node 0's tracker innovations, max over rounds of |innovation| / noise scale"
    else:
        released = push_sum_released(transcripts, topology, x0=torch.zeros(design.dimension), lr=lr, **common)
        # in the units of the clipped sum (times each node's public expected batch size qJ), where the noise lives
        batch = np.array([e.expected_batch_size for e in engines])
        canary_releases = released[:, :, coords].numpy() * batch[:, None, None]  # (nodes, rounds, m)
        if isinstance(engine, DecorNode):
            weights = _decor_weights(engine, graph, 0)
            scores = np.einsum("k,ktm->m", weights, canary_releases)
            observer = "every message of every node (eavesdropper); generalised least squares across nodes"
            noise = {"sigma_cdp": engine.sigma_cdp, "sigma_cor": engine.sigma_cor, "adversary": engine.adversary}
        elif isinstance(engine, DynD2PNode):
            schedule = engine.schedule
            assert schedule is not None
            weights = np.array([1.0 / (schedule.noise_multiplier(t) ** 2 * schedule.clip(t)) for t in range(steps)])
            scores = np.einsum("t,tm->m", weights, canary_releases[0])
            observer = "every message; node 0's released gradients, step t weighted by C_t / (sigma_t C_t)^2"
            noise = {"sigma_first": schedule.noise_multiplier(0), "sigma_last": schedule.noise_multiplier(steps - 1),
                     "clip_first": schedule.clip(0), "clip_last": schedule.clip(steps - 1)}
        else:
            scores = canary_releases[0].sum(0)
            observer = "every message; node 0's released gradients summed over the rounds"
            noise = {"noise_multiplier": engine.noise_multiplier, "max_grad_norm": engine.parameters.max_grad_norm}
            if isinstance(engine, PrivSGPVRNode):
                noise["split"] = engine.split
    outcome = score_audit(scores, included, delta=engine.delta, confidence=confidence, guess_counts=guess_counts,
                          seed=seed)
    return AuditReport(
        strategy=strategy,
        broken=broken,
        claimed_epsilon=float(engine.epsilon()) if claimed is None else claimed,
        delta=float(engine.delta),
        lower_bound=outcome.epsilon,
        confidence=confidence,
        canaries=canaries,
        included=int(included.sum()),
        guesses=outcome.guesses,
        correct=outcome.correct,
        steps=steps,
        nodes=nodes,
        sample_rate=float(engine.sample_rate),  # type: ignore[arg-type]
        observer=observer,
        noise=noise,
        seconds=time.perf_counter() - started,
    )
