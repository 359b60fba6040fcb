"""CPGT: Compressed differentially Private Gradient Tracking (Xie, Yi, Wang, Cao, Ren: "Compressed Differentially
Private Distributed Optimization with Linear Convergence"), Algorithm 1, one agent i.

Before training (identically at every node): alpha and d from the user's plain SGD and model, Theorem 2's conditions
alpha < 1/(2L), q > (alpha L + sqrt(alpha^2 L^2 + 4 alpha L)) / 2; the adjacency distance 2 C / (q J) of Definition 1
from per-sample clipping; d_x, d_y given, or d_x = d_y calibrated to the budget by Theorem 2's bound (the paper's
eq. (23), or the sound bound its proof gives, :mod:`~lightning_privdec.privacy.accounting.cpgt`).
                                     :meth:`CPGTNode.configure_optimizer`, :meth:`CPGTNode.plan_noise`

Per round k (the paper's line numbers):

    init  x_i(0) given; replicas x_j^c(-1) = y_j^c(-1) = 0 for j = i and every neighbour; u_i(0) = 0, so that
          y_i(0) = grad f_i(x_i(0))                                              :meth:`CPGTGossip.__init__`
    (g)   g_k = grad f_i(x_i(k)): per-sample gradients clipped to C, summed, divided by q J   :meth:`CPGTNode.privatize`
    10    y_i(k) = u_i(k) + g_k into p.grad (eq. (10), one gradient per round)   :meth:`CPGTNode.privatize`,
          :meth:`CPGTGossip.track`; descent x_i(k) - alpha y_i(k): the user's plain SGD with lr = alpha
    5     eta_x ~ Lap_d(d_x q^k),  eta_y ~ Lap_d(d_y q^k)                 (this node's own generator)
    6     x_i^a = x_i(k) + eta_x,  y_i^a = y_i(k) + eta_y                                            (5)-(6)
    7     send C(x_i^a - x_i^c(k-1)) and C(y_i^a - y_i^c(k-1)) to every neighbour    (the only messages)
    8     receive C(x_j^a - x_j^c(k-1)), C(y_j^a - y_j^c(k-1)) from every neighbour j
    9     x_j^c(k) = x_j^c(k-1) + C(.),  y_j^c(k) = y_j^c(k-1) + C(.)   for j = i and every neighbour    (11)-(12)
    10    x_i(k+1) = x_i^a + gamma sum_j w_ij (x_j^c(k) - x_i^c(k)) - alpha y_i(k)                      (9)
          u_i(k+1) = y_i^a + gamma sum_j w_ij (y_j^c(k) - y_i^c(k)) - g_k, so that
          y_i(k+1) = u_i(k+1) + g_{k+1}                                             (10)
                                                   lines 5-10: :meth:`CPGTGossip.step`
    (acc) one round of the Laplace mechanism, pure epsilon-DP (delta = 0)
                                      :class:`~lightning_privdec.privacy.accounting.cpgt.CPGTAccountant`

W is doubly stochastic on a static undirected graph. With C = identity and gamma = 1 this is DiaDSP (Ding et al.
2021): x_i(k+1) = sum_j w_ij x_j^a - alpha y_i(k), eq. (7). The compressor's randomness is keyed by public (seed,
sender, channel, round) integers: independent of the data and of the noise, so compression is post-processing
(Theorem 2's proof shares it between the coupled runs).

Differences from the paper, on purpose: per-sample clipping bounds the adjacency distance (2 C / (q J)); the
whole-run accountings need full batches (Assumption 4 fails under mini-batches); ``accounting="sound"`` (default)
carries the 1/q and sqrt(d) the paper's eq. (23) drops (``"theorem2"`` gives eq. (23) verbatim).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.algorithms.consensus_step import ConsensusStep, choose_consensus_step
from lightning_privdec.algorithms.mixing import message_key
from lightning_privdec.comm import Exchange, TensorSpec
from lightning_privdec.compression import Compressor, Identity
from lightning_privdec.privacy.accounting.cpgt import (
    ACCOUNTING,
    CPGTAccountant,
    LaplaceRounds,
    calibrate_cpgt_noise,
    check_theorem2,
    clipping_sensitivity,
    cpgt_epsilon_for,
    laplace_norm_factor,
)
from lightning_privdec.privacy.config import DEFAULT_DELTA, PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.noise import NoiseGenerator, node_noise_generator
from lightning_privdec.tensors import split_like
from lightning_privdec.topology import Topology, TopologyError

__all__ = ["CHANNEL_X", "CHANNEL_Y", "CPGTGossip", "CPGTNode", "CPGTOptions", "laplace_noise", "plain_sgd_step_size"]

CHANNEL_X, CHANNEL_Y = 0, 1  # compressor keys of the two messages of a round
NOISE_STREAM = "cpgt-laplace"
NO_GAUSSIAN_NOISE = "noise_multiplier=0 adds no noise"  # PrivacyParameters' warning, not for CPGT's Laplace noise


def laplace_noise(
    numel: int, scale: float, generator: NoiseGenerator, dtype: torch.dtype = torch.float64
) -> Tensor:
    """Lap_d(scale): d i.i.d. Laplace(scale) entries from this agent's secret ``generator`` (ChaCha20,
    :meth:`~lightning_privdec.privacy.noise.NoiseGenerator.laplace`), on the generator's device."""
    return generator.laplace(numel, scale, dtype)


def _finite_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


@dataclass(frozen=True)
class CPGTOptions:
    """CPGT's own arguments, validated once (by the strategy when it is built, before any process starts).

    ``noise_x``, ``noise_y``: the Laplace scales d_x, d_y, or both ``None`` to calibrate d_x = d_y to the budget.
    ``noise_decay``: q in (0, 1). ``lipschitz``: L, assumed for every node's (clipped, averaged) gradient.
    ``sensitivity``: the adjacency distance, ``None``: 2 C / (q J) from clipping. ``sensitivity_norm``: ``"l2"`` or
    ``"l1"`` (an explicit l1 sensitivity and L). ``accounting``: ``"sound"``, ``"theorem2"`` or ``"finite"``.
    """

    noise_decay: float
    lipschitz: float
    noise_x: float | None = None
    noise_y: float | None = None
    sensitivity: float | None = None
    sensitivity_norm: str = "l2"
    accounting: str = "sound"

    def __post_init__(self) -> None:
        for name in ("noise_x", "noise_y", "sensitivity"):
            value = getattr(self, name)
            if value is not None and not _finite_positive(value):
                raise PrivacyConfigError(f"CPGT: {name} must be a finite number > 0, got {value!r}")
        if not _finite_positive(self.lipschitz):
            raise PrivacyConfigError(
                f"CPGT: lipschitz (L, the smoothness constant assumed for each node's gradient) must be a finite "
                f"number > 0, got {self.lipschitz!r}"
            )
        if not (isinstance(self.noise_decay, (int, float)) and 0 < self.noise_decay < 1):
            raise PrivacyConfigError(f"CPGT: noise_decay (q) must lie in (0, 1), got {self.noise_decay!r}")
        if self.accounting not in ACCOUNTING:
            raise PrivacyConfigError(f"CPGT: accounting must be one of {ACCOUNTING}, got {self.accounting!r}")
        if self.sensitivity_norm not in ("l2", "l1"):
            raise PrivacyConfigError(f"CPGT: sensitivity_norm must be 'l2' or 'l1', got {self.sensitivity_norm!r}")
        if self.sensitivity_norm == "l1" and self.sensitivity is None:
            raise PrivacyConfigError(
                "CPGT: sensitivity_norm='l1' needs an explicit l1 sensitivity=...: the distance derived from "
                "per-sample clipping, 2C/(qJ), is an l2 bound (keep sensitivity_norm='l2' to use it)"
            )

    @staticmethod
    def privacy_parameters(max_grad_norm: float, target_epsilon: float | None = None) -> PrivacyParameters:
        """The clipping bound C and the budget for :class:`CPGTNode`: no Gaussian noise, and the nominal delta the
        parameter check asks of a budget (unused: CPGT is pure epsilon-DP)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NO_GAUSSIAN_NOISE)
            return PrivacyParameters(
                max_grad_norm=max_grad_norm, noise_multiplier=0.0, target_epsilon=target_epsilon,
                target_delta=DEFAULT_DELTA if target_epsilon is not None else None,
            ).validate()

    @staticmethod
    def check_noise_or_budget(noise_x: float | None, noise_y: float | None, target_epsilon: float | None) -> None:
        """Both Laplace scales, or neither and a budget to calibrate them to."""
        if (noise_x is None) != (noise_y is None):
            raise PrivacyConfigError("give both noise_x and noise_y (the Laplace scales d_x, d_y), or neither")
        if noise_x is None and target_epsilon is None:
            raise PrivacyConfigError(
                "CPGT needs its Laplace noise scales: pass noise_x=... and noise_y=..., or target_epsilon=... to "
                "calibrate them (d_x = d_y)"
            )
        if target_epsilon is not None and not _finite_positive(target_epsilon):
            raise PrivacyConfigError(f"CPGT: target_epsilon must be a finite number > 0, got {target_epsilon!r}")


def plain_sgd_step_size(optimizer: torch.optim.Optimizer) -> float:
    """alpha, the one learning rate of a plain SGD optimizer (no momentum, weight decay, Nesterov or maximize);
    raises :class:`PrivacyConfigError` for anything else: CPGT's x(k) - alpha y(k) is exactly such a step."""
    groups = optimizer.param_groups
    if type(optimizer) is not torch.optim.SGD or any(
        g.get("momentum", 0) or g.get("weight_decay", 0) or g.get("nesterov", False) or g.get("maximize", False)
        for g in groups
    ):
        keys = ("momentum", "weight_decay", "nesterov", "maximize")
        settings = [{k: g.get(k) for k in keys if k in g} for g in groups]
        raise PrivacyConfigError(
            f"CPGT's update x(k+1) = x^a + gamma sum_j w_ij (x_j^c - x_i^c) - alpha y(k) needs plain SGD whose "
            f"learning rate is alpha; got {type(optimizer).__name__} with {settings}. Return "
            "torch.optim.SGD(params, lr=alpha) (momentum=0, weight_decay=0) from configure_optimizers."
        )
    rates = {float(g["lr"]) for g in groups}
    if len(rates) != 1:
        raise PrivacyConfigError(f"CPGT uses one step size alpha; the parameter groups have learning rates {rates}")
    return rates.pop()


class CPGTNode(PrivateNodeAlgorithm):
    """One CPGT agent: clipping without Gaussian noise, the tracking gossip with Laplace noise, Theorem 2's epsilon.

    Args:
        parameters: ``max_grad_norm`` (C), ``noise_multiplier=0`` (no Gaussian noise), the budget ``target_epsilon``.
        options: :class:`CPGTOptions`.
        rank, device, grad_sample_mode, noise_seed: see :class:`PrivateNodeAlgorithm`.
    """

    def __init__(self, parameters: PrivacyParameters, *, options: CPGTOptions, **kwargs: Any) -> None:
        self.options = options
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NO_GAUSSIAN_NOISE)
            super().__init__(parameters, **kwargs)
        self.noise_x, self.noise_y = options.noise_x, options.noise_y
        self.noise_decay, self.lipschitz, self.accounting = options.noise_decay, options.lipschitz, options.accounting
        self.sensitivity = options.sensitivity
        self.noise_multiplier = 0.0  # no Gaussian noise: reported as 0 by the budget callback
        self.alpha: float | None = None
        self.dimension: int | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.gossip: CPGTGossip | None = None

    def make_accountant(self) -> CPGTAccountant:
        return CPGTAccountant(self.options.accounting)

    @property
    def delta(self) -> float:
        return 0.0  # pure epsilon-DP

    def build_gossip(  # type: ignore[override]
        self, x0: Tensor, *, rank: int, topology: Topology, exchange: Exchange, compressor: Compressor | None,
        push_sum_weight: bool, seed: int, consensus_step: float | str, staleness: int,
    ) -> CPGTGossip:
        """The tracking gossip (lines 5-10); its Laplace scales are set once planned (:meth:`plan_noise`)."""
        self.gossip = CPGTGossip(
            x0, rank=rank, topology=topology, exchange=exchange, compressor=compressor, consensus_step=consensus_step,
            noise_x=self.noise_x or 0.0, noise_y=self.noise_y or 0.0, noise_decay=self.noise_decay,
            noise_seed=self.noise_seed, seed=seed,
        )
        return self.gossip

    def configure_optimizer(self, optimizer: torch.optim.Optimizer, dimension: int) -> None:
        """alpha (the plain SGD learning rate) and d (the number of trainable parameters); Theorem 2's conditions."""
        self.optimizer, self.alpha, self.dimension = optimizer, plain_sgd_step_size(optimizer), int(dimension)
        laplace_norm_factor(self.dimension, self.options.sensitivity_norm)  # a valid d
        if self.accounting != "finite":
            check_theorem2(self.alpha, self.lipschitz, self.noise_decay)

    # ---- before training: the adjacency distance and the Laplace scales ------------------------------------------
    def _batch_size_for_shard(self, batch_size: int, shard_size: int) -> int:
        """Whole-run accountings need full batches: a batch size of at least the shard size means q = 1 (all of J).

        Assumption 4 (one example moves the gradient by a constant vector) fails under mini-batches: the example is in
        some batches and not in others, its difference enters the tracker afresh each time, under noise that decays to
        zero. The privacy audit (docs/audit.md) measures epsilon >= 4.6 against a claimed 2 with q = 0.1.
        """
        if batch_size >= shard_size:
            return shard_size
        if self.accounting != "finite":
            raise PrivacyConfigError(
                f"CPGT: accounting={self.accounting!r} needs full batches (Assumption 4 fails under mini-batches: an "
                f"example enters the tracker afresh each time it is sampled), but node {self.rank} would sample "
                f"{batch_size} of its {shard_size} examples per step. Use a batch size of at least the largest "
                "node's shard (every node then uses all of its data each step), or accounting='finite'"
            )
        return batch_size

    def plan_noise(self, planned_steps: int) -> None:
        """The adjacency distance 2 C / (q J); d_x = d_y calibrated to the target over the plan (unless given); a
        whole-run bound over the target is refused. The scales go to the gossip."""
        if self.alpha is None or self.dimension is None:
            raise RuntimeError("CPGTNode.configure_optimizer(optimizer, dimension) must run before planning")
        assert self.expected_batch_size is not None
        if self.options.sensitivity is None:
            self.sensitivity = clipping_sensitivity(self.parameters.max_grad_norm, self.expected_batch_size)
        assert self.sensitivity is not None
        norm_factor = laplace_norm_factor(self.dimension, self.options.sensitivity_norm)
        common = dict(alpha=self.alpha, lipschitz=self.lipschitz, q=self.noise_decay, sensitivity=self.sensitivity)
        target = self.parameters.target_epsilon
        if self.noise_x is None:  # calibrate d_x = d_y = d to the target over the plan
            assert target is not None
            self.noise_x = self.noise_y = calibrate_cpgt_noise(
                target, self.accounting, steps=max(1, planned_steps), norm_factor=norm_factor, **common,  # type: ignore[arg-type]
            )
        assert self.noise_y is not None
        self.ledger.mechanism = LaplaceRounds(noise_x=self.noise_x, noise_y=self.noise_y, norm_factor=norm_factor,
                                              **common)  # type: ignore[arg-type]
        run_epsilon = self.run_epsilon
        if run_epsilon is not None and target is not None and run_epsilon > target * (1 + 1e-9):
            raise PrivacyConfigError(
                f"CPGT: noise_x = {self.noise_x:g}, noise_y = {self.noise_y:g} give epsilon = {run_epsilon:.4g} "
                f"({self.accounting} accounting) > target_epsilon = {target:g}; "
                "raise the noise scales or the budget, or give only target_epsilon to calibrate them"
            )
        if self.gossip is not None:
            self.gossip.set_noise(self.noise_x, self.noise_y)

    @property
    def run_epsilon(self) -> float | None:
        """The whole-run bound of the sound or theorem2 accounting (``None`` for finite, or before planning)."""
        if self.accounting == "finite" or self.ledger.mechanism is None:
            return None
        return self.ledger.trajectory_epsilon(None)

    @property
    def epsilon_theorem2(self) -> float | None:
        """The paper's eq. (23), for reference (``None`` for finite accounting, or before planning)."""
        m = self.ledger.mechanism
        if self.accounting == "finite" or m is None:
            return None
        return cpgt_epsilon_for("theorem2", steps=None, alpha=m.alpha, lipschitz=m.lipschitz, q=m.q,
                                noise_x=m.noise_x, noise_y=m.noise_y, sensitivity=m.sensitivity)

    def next_release(self) -> tuple[LaplaceRounds] | None:
        return None if self.ledger.mechanism is None else (self.ledger.mechanism,)

    # ---- round k: the clipped gradient and the tracker ----------------------------------------------------------
    def privatize(self) -> DPStepStats:
        """g_k: per-sample gradients clipped to C, summed, divided by q J; records round k; then p.grad <- y_i(k) =
        u_i(k) + g_k (line 10, eq. (10)) for the user's plain SGD step x_i(k) - alpha y_i(k)."""
        gossip, optimizer = self.gossip, self.optimizer
        if gossip is None or optimizer is None or self.next_release() is None or self._module is None:
            raise RuntimeError("CPGT: the Laplace noise was not planned before the first step")
        if any(float(g["lr"]) != self.alpha for g in optimizer.param_groups):
            raise PrivacyConfigError(
                f"CPGT: the learning rate changed from alpha = {self.alpha} during training; the privacy bound "
                "assumes a constant step size"
            )
        self.last_step = self.clip_and_noise(self.parameters.max_grad_norm, noise_multiplier=0.0)
        self.ledger.record(*self.next_release())  # type: ignore[misc]
        params = [p for p in self._module.parameters() if p.requires_grad]
        y = gossip.track(torch.cat([p.grad.reshape(-1) for p in params]))
        for p, y_p in zip(params, split_like(y, params)):
            p.grad.copy_(y_p)
        return self.last_step

    def noise_summary(self) -> str:
        replayed = self.ledger.steps - self.ledger.rounds
        return (
            f"pure epsilon-DP (delta = 0): Laplace noise d_x = {self.noise_x or 0.0:.4g}, d_y = {self.noise_y or 0.0:.4g} "
            f"decaying by q = {self.noise_decay} per round, {self.accounting} accounting"
            + (f", {replayed} replayed rounds charged" if replayed else "")
        )

    # ---- checkpoints: a resume re-sends the rounds released after the checkpoint ---------------------------------
    def plan_state(self) -> dict[str, Any]:
        return {"noise": [self.noise_x, self.noise_y], "sensitivity": self.sensitivity}

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        noise_x, noise_y = state["noise"]
        if noise_x is not None:  # a calibrated scale is kept: the run goes on with the noise it has used
            self.noise_x, self.noise_y = float(noise_x), float(noise_y)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(_with_ledger(state))

    def load_accounting_state(self, state: Mapping[str, Any]) -> None:
        """The write-ahead ledger's later state of this run: the trajectory restarts at the checkpoint's round k0
        (the gossip's round counter), and rounds k0..k1-1 are recorded as replayed (charged again as re-sent)."""
        state = _with_ledger(state)
        super().load_accounting_state({**state, "ledger": self.ledger.replayed_state(state["ledger"])})


def _with_ledger(state: Mapping[str, Any]) -> dict[str, Any]:
    """A node state in the current layout; checkpoints before the common accountant kept the ledger's keys at the
    top level (``steps``, ``replayed``)."""
    if "ledger" in state:
        return dict(state)
    rest = {key: value for key, value in state.items() if key not in ("steps", "replayed")}
    return {**rest, "ledger": {"steps": state["steps"], "replayed": state.get("replayed", [])}}


class CPGTGossip:
    """One agent's CPGT state: x_i, u_i, the replicas x_j^c, y_j^c (j = i and neighbours) and a round counter.

    Args:
        x: x_i(0), flat (the gossip keeps its own copy).
        rank: this agent's id.
        topology: static, undirected; ``mixing_matrix(0)`` must be doubly stochastic (e.g. Metropolis weights).
        exchange: moves the messages (torch.distributed or loopback).
        compressor: C; ``None`` or :class:`Identity` sends the differences uncompressed.
        consensus_step: gamma > 0, or ``"auto"`` (:mod:`lightning_privdec.algorithms.consensus_step`: 1 without
            compression).
        noise_x, noise_y: d_x, d_y >= 0 (0: no noise on that variable, not private).
        noise_decay: q in (0, 1].
        noise_seed: ``None`` (default): the Laplace noise comes from OS entropy, unknown to everyone else; an int:
            reproducible noise derived from (seed, rank), for tests only.
        seed: shared by all agents; keys the compressor's randomness.
    """

    def __init__(
        self,
        x: Tensor,
        *,
        rank: int,
        topology: Topology,
        exchange: Exchange,
        compressor: Compressor | None = None,
        consensus_step: float | str = 1.0,
        noise_x: float,
        noise_y: float,
        noise_decay: float,
        noise_seed: int | None = None,
        seed: int = 0,
    ) -> None:
        if x.dim() != 1:
            raise ValueError(f"CPGT gossips one flat vector; got shape {tuple(x.shape)}")
        if not topology.is_static or not topology.is_symmetric:
            raise TopologyError(
                f"CPGT needs a static undirected graph (Assumption 2); topology {topology.name!r} is "
                f"{'time-varying' if not topology.is_static else 'directed'}. Use 'ring', 'torus', 'complete' or an "
                "nx.Graph"
            )
        self.consensus_step_choice: ConsensusStep | None = None  # how "auto" chose gamma (None when given)
        if consensus_step == "auto":
            self.consensus_step_choice = choose_consensus_step(compressor, topology, x.numel())
            consensus_step = self.consensus_step_choice.gamma
        if isinstance(consensus_step, bool) or not isinstance(consensus_step, (int, float)) or not consensus_step > 0:
            raise ValueError(f"consensus_step (gamma) must be 'auto' or a number > 0, got {consensus_step!r}")
        if not 0.0 < noise_decay <= 1.0:
            raise ValueError(f"noise_decay (q) must lie in (0, 1], got {noise_decay}")
        self.rank = rank
        self.topology = topology
        self.exchange = exchange
        self.compressor: Compressor = Identity() if compressor is None else compressor
        self.gamma = float(consensus_step)
        self.seed = seed
        self.noise_seed = noise_seed
        self.noise_decay = float(noise_decay)
        self.set_noise(noise_x, noise_y)
        self.generator = node_noise_generator(x.device, noise_seed, rank, stream=NOISE_STREAM)
        matrix = topology.mixing_matrix(0)
        self.neighbours = tuple(topology.in_peers(rank, 0))
        self.weights = {j: float(matrix[rank, j]) for j in self.neighbours}  # w_ij
        self.round = 0
        self.x = x.detach().clone()  # x_i(k), the clean state
        self.u = torch.zeros_like(self.x)  # u_i(k) = y_i(k) - grad f_i(x_i(k)); u_i(0) = 0
        self.y: Tensor | None = None  # y_i(k), set by track()
        self._grad: Tensor | None = None  # grad f_i(x_i(k)), set by track()
        zeros = torch.zeros_like(self.x)
        self.x_copies = {j: zeros.clone() for j in (rank, *self.neighbours)}  # x_j^c(k-1)
        self.y_copies = {j: zeros.clone() for j in (rank, *self.neighbours)}  # y_j^c(k-1)
        self.last_noise: tuple[Tensor, Tensor] | None = None  # (eta_x(k), eta_y(k)) of the last round, diagnostics

    def set_noise(self, noise_x: float, noise_y: float) -> None:
        """d_x and d_y (both >= 0); :meth:`CPGTNode.plan_noise` sets them once planned."""
        if not (noise_x >= 0 and noise_y >= 0):
            raise ValueError(f"noise scales must be >= 0, got noise_x={noise_x}, noise_y={noise_y}")
        self.noise_x, self.noise_y = float(noise_x), float(noise_y)

    # ----------------------------------------------------------------------------------------------------------------
    @property
    def dimension(self) -> int:
        return self.x.numel()

    def uncompressed_message_nbytes(self) -> int:
        """Bytes of one message without compression: the state and the tracker differences, d values each."""
        return 2 * self.x.numel() * self.x.element_size()

    @property
    def z(self) -> Tensor:
        """The model to evaluate gradients at: x_i(k) itself (no push-sum weight)."""
        return self.x.clone()

    def debias_into(self, out: Tensor) -> None:
        """Write x_i(k) into ``out`` (the module's parameters): gradients are taken at the clean state."""
        out.copy_(self.x)

    def track(self, grad: Tensor) -> Tensor:
        """y_i(k) = u_i(k) + grad f_i(x_i(k)) (line 10, second half, with y_i(0) = grad f_i(x_i(0))); returns y_i(k)."""
        self._grad = grad.detach().to(self.x.dtype).clone()
        self.y = self.u + self._grad
        return self.y

    # ----------------------------------------------------------------------------------------------------------------
    def step(self, x_half: Tensor) -> None:
        """One round, lines 5-10, given x_half = x_i(k) - alpha y_i(k) (the caller's descent step)."""
        if self.y is None or self._grad is None:
            raise RuntimeError("CPGTGossip.step needs track(grad f_i(x_i(k))) first, once per round")
        k, d, dtype = self.round, self.dimension, self.x.dtype
        decay = self.noise_decay**k
        # Lines 5-6: eta ~ Lap_d(d q^k); x^a = x + eta_x, y^a = y + eta_y
        eta_x = laplace_noise(d, self.noise_x * decay, self.generator, dtype).to(self.x.device)
        eta_y = laplace_noise(d, self.noise_y * decay, self.generator, dtype).to(self.x.device)
        x_a, y_a = self.x + eta_x, self.y + eta_y
        # Line 7: the compressed differences are the only messages
        payload_x = self._compress(x_a - self.x_copies[self.rank], CHANNEL_X)
        payload_y = self._compress(y_a - self.y_copies[self.rank], CHANNEL_Y)
        # Line 8: exchange with every neighbour (undirected: in-peers = out-peers)
        spec = [TensorSpec(tuple(s), dt) for s, dt in self.compressor.payload_spec(d, dtype)]
        received = self.exchange.exchange(
            {j: [*payload_x, *payload_y] for j in self.neighbours}, {j: spec + spec for j in self.neighbours}
        )
        # Line 9 (11)-(12): x_j^c(k) = x_j^c(k-1) + C(.), y_j^c(k) likewise, for j = i and every neighbour
        self._add_to_copies(self.rank, payload_x, payload_y)
        for j in self.neighbours:
            self._add_to_copies(j, received[j][: len(spec)], received[j][len(spec) :], sender=j)
        # Line 10 (9): x(k+1) = x^a + gamma sum_j w_ij (x_j^c - x_i^c) - alpha y(k), alpha y(k) = x(k) - x_half
        descent = self.x - x_half.to(dtype)
        x_next = x_a + self.gamma * self._consensus(self.x_copies) - descent
        # Line 10 (10), all but grad f_i(x(k+1)): u(k+1) = y^a + gamma sum_j w_ij (y_j^c - y_i^c) - grad f_i(x(k))
        self.u = y_a + self.gamma * self._consensus(self.y_copies) - self._grad
        self.x = x_next
        self.y = self._grad = None
        self.last_noise = (eta_x, eta_y)
        self.round += 1

    def _compress(self, difference: Tensor, channel: int) -> list[Tensor]:
        return self.compressor.encode(difference, message_key(self.seed, self.rank, channel, self.round))

    def _add_to_copies(
        self, j: int, payload_x: list[Tensor], payload_y: list[Tensor], sender: int | None = None
    ) -> None:
        sender = self.rank if sender is None else sender
        d, dtype = self.dimension, self.x.dtype
        for copies, payload, channel in ((self.x_copies, payload_x, CHANNEL_X), (self.y_copies, payload_y, CHANNEL_Y)):
            key = message_key(self.seed, sender, channel, self.round)
            copies[j].add_(self.compressor.decode(payload, d, key, dtype=dtype))

    def _consensus(self, copies: Mapping[int, Tensor]) -> Tensor:
        """sum_j w_ij (c_j - c_i) over the neighbours (the j = i term is zero)."""
        total = torch.zeros_like(self.x)
        for j in self.neighbours:
            total.add_(copies[j] - copies[self.rank], alpha=self.weights[j])
        return total

    # ---- checkpointing ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Round, x, u, every replica and the traffic; the noise generator's draw count only with a fixed
        ``noise_seed`` (a secure generator's key is never saved)."""
        state: dict[str, Any] = {
            "round": self.round,
            "x": self.x.detach().cpu().clone(),
            "u": self.u.detach().cpu().clone(),
            "x_copies": {j: t.detach().cpu().clone() for j, t in self.x_copies.items()},
            "y_copies": {j: t.detach().cpu().clone() for j, t in self.y_copies.items()},
            "noise": [self.noise_x, self.noise_y, self.noise_decay],
            "traffic": self.exchange.traffic.state_dict(),
        }
        if self.noise_seed is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        device = self.x.device
        self.round = int(state["round"])
        self.x = state["x"].to(device=device, dtype=self.x.dtype).clone()
        self.u = state["u"].to(device=device, dtype=self.x.dtype).clone()
        self.x_copies = {int(j): t.to(device).clone() for j, t in state["x_copies"].items()}
        self.y_copies = {int(j): t.to(device).clone() for j, t in state["y_copies"].items()}
        noise_x, noise_y, self.noise_decay = (float(v) for v in state["noise"])
        self.set_noise(noise_x, noise_y)
        self.y = self._grad = None
        self.exchange.traffic.load_state_dict(state["traffic"])
        if self.noise_seed is not None and "generator" in state:
            self.generator.set_state(state["generator"])
