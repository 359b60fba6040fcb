"""CPGT: Compressed differentially Private Gradient Tracking (Xie, Yi, Wang, Cao, Ren), Algorithm 1, one agent i:

    1-2   alpha = the SGD learning rate, d_x, d_y, q planned; x_i(0) given; x_j^c(-1) = y_j^c(-1) = 0 for j = i
          and every neighbour; y_i(0) = grad f_i(x_i(0))           :meth:`CPGTNode.configure_optimizer`,
                                                                   :meth:`CPGTNode.plan_noise`, :class:`CPGTGossip`
    3-4   for k = 0..K-1: g_k = grad f_i(x_i(k)) from per-sample gradients clipped to C, over q J, and
          y_i(k) = u_i(k) + g_k into p.grad (eq. (10)'s gradient term, taken at the start of the next round: one
          gradient per round); the round recorded in the accountant              :meth:`CPGTNode.privatize`
          the descent - alpha y_i(k) of (9): the user's plain SGD (``lr`` = alpha)
    5     eta_x ~ Lap_d(d_x q^k),  eta_y ~ Lap_d(d_y q^k)   (this node's own generator)    :meth:`CPGTGossip.step`
    6     x_i^a = x_i(k) + eta_x,  y_i^a = y_i(k) + eta_y                                  (5)-(6)
    7     send C(x_i^a - x_i^c(k-1)) and C(y_i^a - y_i^c(k-1)) to every neighbour   (the only messages)
    8     receive C(x_j^a - x_j^c(k-1)), C(y_j^a - y_j^c(k-1)) from every neighbour j
    9     x_j^c(k) = x_j^c(k-1) + C(.),  y_j^c(k) = y_j^c(k-1) + C(.)   for j = i and every neighbour  (11)-(12)
    10    x_i(k+1) = x_i^a + gamma sum_j w_ij (x_j^c(k) - x_i^c(k)) - alpha y_i(k)                    (9)
          y_i(k+1) = y_i^a + gamma sum_j w_ij (y_j^c(k) - y_i^c(k)) + grad f_i(x_i(k+1)) - grad f_i(x_i(k))  (10)

W is doubly stochastic on a static undirected graph. With C = identity and gamma = 1 this is DiaDSP (Ding et al.
2021): x_i(k+1) = sum_j w_ij x_j^a - alpha y_i(k), eq. (7). :meth:`CPGTGossip.track` keeps
u_i(k+1) = y_i^a + gamma sum_j w_ij (y_j^c - y_i^c) - g_k from the previous round (u_i(0) = 0 gives y_i(0) = g_0).

The privacy is pure epsilon-DP of the node's messages (Theorem 2, delta = 0), accounted by
:class:`~lightning_privdec.privacy.accounting.cpgt.CPGTAccountant`. The compressor's randomness is keyed by public
(seed, sender, channel, round) integers, independent of data and noise: compression is post-processing.
"""

from __future__ import annotations

import math
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
    LaplaceTracking,
    calibrate_cpgt_noise,
    check_theorem2,
    clipping_sensitivity,
    laplace_norm_factor,
    positive_number,
)
from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.noise import NoiseGenerator, node_noise_generator
from lightning_privdec.tensors import split_like
from lightning_privdec.topology import Topology, TopologyError

__all__ = ["CHANNEL_X", "CHANNEL_Y", "CPGTGossip", "CPGTNode", "CPGTOptions", "laplace_noise", "plain_sgd_step_size"]

CHANNEL_X, CHANNEL_Y = 0, 1  # compressor keys of the two messages of a round
NOISE_STREAM = "cpgt-laplace"


def plain_sgd_step_size(optimizer: torch.optim.Optimizer) -> float:
    """alpha, the one learning rate of a plain SGD optimizer (no momentum, weight decay, Nesterov or maximize);
    raises :class:`PrivacyConfigError` for anything else: line 10's x(k) - alpha y(k) is exactly such a step."""
    groups = optimizer.param_groups
    keys = ("momentum", "weight_decay", "nesterov", "maximize")
    if type(optimizer) is not torch.optim.SGD or any(g.get(k, 0) for g in groups for k in keys):
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


@dataclass(frozen=True)
class CPGTOptions:
    """CPGT's own arguments, validated once (by the strategy when it is built, before any process starts).

    ``noise_x``, ``noise_y``: d_x, d_y, or both ``None`` to calibrate d_x = d_y to ``target_epsilon``. ``noise_decay``:
    q in (0, 1). ``lipschitz``: L, assumed. ``sensitivity``: the adjacency distance (``None``: 2 C / (q J) from the
    clipping). ``sensitivity_norm``: ``"l2"`` or ``"l1"``. ``accounting``: ``"sound"``, ``"theorem2"`` or ``"finite"``.
    """

    noise_decay: float
    lipschitz: float
    noise_x: float | None = None
    noise_y: float | None = None
    sensitivity: float | None = None
    sensitivity_norm: str = "l2"
    accounting: str = "sound"

    def __post_init__(self) -> None:
        if (self.noise_x is None) != (self.noise_y is None):
            raise PrivacyConfigError("give both noise_x and noise_y (the Laplace scales d_x, d_y), or neither")
        for name in ("noise_x", "noise_y", "sensitivity"):
            if getattr(self, name) is not None:
                positive_number(getattr(self, name), name)
        if not (isinstance(self.lipschitz, (int, float)) and 0 < self.lipschitz < math.inf):
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

    def check_budget(self, target_epsilon: float | None) -> None:
        """The Laplace scales, or a budget to calibrate them to."""
        if self.noise_x is None and target_epsilon is None:
            raise PrivacyConfigError(
                "CPGT needs its Laplace noise scales: pass noise_x=... and noise_y=..., or target_epsilon=... to "
                "calibrate them (d_x = d_y)"
            )
        if target_epsilon is not None:
            positive_number(target_epsilon, "target_epsilon")


class CPGTNode(PrivateNodeAlgorithm):
    """One CPGT agent: per-sample clipping without Gaussian noise, the tracking step, and Theorem 2's accounting.

    Args:
        parameters: ``max_grad_norm`` (C), ``noise_multiplier=0`` (no Gaussian noise) and the budget, if any.
        options: CPGT's own arguments (:class:`CPGTOptions`).
        rank, device, grad_sample_mode, noise_seed: see :class:`PrivateNodeAlgorithm`.
    """

    ledger: CPGTAccountant

    def __init__(self, parameters: PrivacyParameters, *, options: CPGTOptions, **kwargs: Any) -> None:
        super().__init__(parameters, **kwargs)
        self.options = options
        self.noise_x, self.noise_y = options.noise_x, options.noise_y  # d_x, d_y (calibrated ones are kept)
        self.alpha: float | None = None
        self.dimension: int | None = None
        self.sensitivity: float | None = options.sensitivity
        self.mechanism: LaplaceTracking | None = None  # the plan: what every round releases
        self.gossip: CPGTGossip | None = None
        self.noise_multiplier = 0.0  # no Gaussian noise: reported as 0 by the budget callback
        self._optimizer: torch.optim.Optimizer | None = None

    def make_accountant(self) -> CPGTAccountant:
        return CPGTAccountant()

    @property
    def delta(self) -> float:
        return 0.0  # pure epsilon-DP

    def build_gossip(self, x0: Tensor, *, rank: int, topology: Topology, exchange: Exchange,  # type: ignore[override]
                     compressor: Compressor | None, seed: int, consensus_step: float | str, **_: Any) -> CPGTGossip:
        """Lines 1-2 and 5-10: the tracking gossip; its Laplace scales are set when the noise is planned."""
        self.gossip = CPGTGossip(
            x0, rank=rank, topology=topology, exchange=exchange, compressor=compressor, consensus_step=consensus_step,
            noise_x=0.0, noise_y=0.0, noise_decay=self.options.noise_decay, noise_seed=self.noise_seed, seed=seed,
        )
        return self.gossip

    # ---- lines 1-2: alpha, d and the noise plan ------------------------------------------------------------------
    def configure_optimizer(self, optimizer: torch.optim.Optimizer, dimension: int) -> None:
        self._optimizer = optimizer
        self.configure(step_size=plain_sgd_step_size(optimizer), dimension=dimension)

    def configure(self, *, step_size: float, dimension: int) -> None:
        """alpha (the SGD learning rate) and d (the number of trainable parameters); checks Theorem 2's conditions."""
        self.alpha, self.dimension = float(step_size), int(dimension)
        if self.options.accounting != "finite":
            check_theorem2(self.alpha, self.options.lipschitz, self.options.noise_decay)

    @property
    def norm_factor(self) -> float | None:
        """sqrt(d) for l2 quantities (the Laplace loss is an l1 norm), 1 for l1 ones."""
        return None if self.dimension is None else laplace_norm_factor(self.dimension, self.options.sensitivity_norm)

    def _batch_size_for_shard(self, batch_size: int, shard_size: int) -> int:
        """Whole-run accountings need full batches: a batch size of at least the shard size means q = 1 (all of J).

        Assumption 4 (one example moves the gradient by a constant vector) fails under mini-batches: the example is in
        some batches and not in others, its difference enters the tracker afresh each time, under noise that decays to
        zero. The privacy audit (docs/audit.md) measures epsilon >= 4.6 against a claimed 2 with q = 0.1.
        """
        if batch_size >= shard_size:
            return shard_size
        if self.options.accounting != "finite":
            raise PrivacyConfigError(
                f"CPGT: accounting={self.options.accounting!r} needs full batches (Assumption 4 fails under "
                f"mini-batches: an example enters the tracker afresh each time it is sampled), but node {self.rank} "
                f"would sample {batch_size} of its {shard_size} examples per step. Use a batch size of at least the "
                "largest node's shard (every node then uses all of its data each step), or accounting='finite'"
            )
        return batch_size

    def plan_noise(self, planned_steps: int) -> None:
        """d_x, d_y given or calibrated (d_x = d_y) to the target over the plan; a whole-run bound above the target
        is refused. The gossip draws at these scales from now on."""
        if self.alpha is None or self.norm_factor is None:
            raise RuntimeError("CPGTNode.configure(step_size=..., dimension=...) must run before planning")
        assert self.expected_batch_size is not None
        o, target = self.options, self.parameters.target_epsilon
        if o.sensitivity is None:
            self.sensitivity = clipping_sensitivity(self.parameters.max_grad_norm, self.expected_batch_size)
        assert self.sensitivity is not None
        constants = dict(alpha=self.alpha, lipschitz=o.lipschitz, q=o.noise_decay, sensitivity=self.sensitivity)
        if self.noise_x is None:
            assert target is not None
            self.noise_x = self.noise_y = calibrate_cpgt_noise(
                target, o.accounting, steps=max(1, planned_steps),  # type: ignore[arg-type]
                norm_factor=self.norm_factor, **constants,
            )
        assert self.noise_y is not None
        self.mechanism = self.ledger.mechanism = LaplaceTracking(
            noise_x=self.noise_x, noise_y=self.noise_y, norm_factor=self.norm_factor,
            accounting=o.accounting, **constants,  # type: ignore[arg-type]
        )
        if self.mechanism.whole_run and target is not None and self.run_epsilon > target:  # type: ignore[operator]
            raise PrivacyConfigError(
                f"CPGT: noise_x = {self.noise_x:g}, noise_y = {self.noise_y:g} give epsilon = {self.run_epsilon:.4g} "
                f"({o.accounting} accounting) > target_epsilon = {target:g}; "
                "raise the noise scales or the budget, or give only target_epsilon to calibrate them"
            )
        if self.gossip is not None:
            self.gossip.set_noise(self.noise_x, self.noise_y)

    @property
    def run_epsilon(self) -> float | None:
        """The whole-run bound of the planned trajectory (None: finite accounting, or not planned)."""
        m = self.mechanism
        return m.trajectory_epsilon(0) if m is not None and m.whole_run else None

    def next_release(self) -> tuple[LaplaceTracking] | None:
        return None if self.mechanism is None else (self.mechanism,)

    # ---- lines 3-4: the round's clipped gradient and tracking direction ------------------------------------------
    def privatize(self) -> DPStepStats:
        """p.grad <- y_i(k) = u_i(k) + g_k, with g_k the sum of per-sample gradients clipped to C over q J; records
        the round before its messages leave."""
        release, gossip = self.next_release(), self.gossip
        if release is None or gossip is None or (self.per_sample is None and self.ghost is None):
            raise RuntimeError("CPGTNode.privatize called before attach(), build_gossip() and private_dataloader()")
        if (gossip.noise_x, gossip.noise_y) != (self.noise_x, self.noise_y):
            raise RuntimeError("CPGT: the Laplace noise was not planned before the first step")
        if self._optimizer is not None and any(float(g["lr"]) != self.alpha for g in self._optimizer.param_groups):
            raise PrivacyConfigError(
                f"CPGT: the learning rate changed from alpha = {self.alpha} during training; the privacy bound "
                "assumes a constant step size"
            )
        self.last_step = self.clip_and_noise(self.parameters.max_grad_norm, noise_multiplier=0.0)
        self.ledger.record(*release)
        params = self._trainable
        y = gossip.track(torch.cat([p.grad.reshape(-1) for p in params]))
        for p, chunk in zip(params, split_like(y, params)):
            p.grad.copy_(chunk)
        return self.last_step

    def noise_summary(self) -> str:
        replays = self.ledger.steps - self.ledger.rounds
        return (
            f"pure epsilon-DP (delta = 0): Laplace noise d_x = {self.noise_x or 0.0:.4g}, d_y = "
            f"{self.noise_y or 0.0:.4g} decaying by q = {self.options.noise_decay} per round, "
            f"{self.options.accounting} accounting" + (f", {replays} replayed rounds charged" if replays else "")
        )

    # ---- checkpoints: the ledger, the scales; a crash's released rounds are charged again ------------------------
    def plan_state(self) -> dict[str, Any]:
        return {"noise": [self.noise_x, self.noise_y], "sensitivity": self.sensitivity}

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        noise_x, noise_y = state["noise"]
        if noise_x is not None:  # a calibrated scale is kept: the run goes on with the noise it has used
            self.noise_x, self.noise_y = float(noise_x), float(noise_y)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(_with_ledger(state))

    def load_accounting_state(self, state: Mapping[str, Any]) -> None:
        """The write-ahead ledger's later state of this run: rounds released after the checkpoint are replayed."""
        state = _with_ledger(state)
        super().load_accounting_state({**state, "ledger": self.ledger.replay_state(state["ledger"])})


def _with_ledger(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """A node state; one saved before the accountant kept its own (``steps``, ``replayed`` at the top) converted."""
    if "ledger" in state:
        return state
    return {**state, "ledger": {"rounds": int(state["steps"]), "replayed": state.get("replayed", [])}}


def laplace_noise(numel: int, scale: float, generator: NoiseGenerator, dtype: torch.dtype = torch.float64) -> Tensor:
    """Lap_d(scale): d i.i.d. Laplace(scale) entries from this agent's secret ``generator`` (ChaCha20)."""
    return generator.laplace(numel, scale, dtype)


class CPGTGossip:
    """One agent's CPGT state: x_i, u_i, the replicas x_j^c, y_j^c (j = i and neighbours) and a round counter.

    Args:
        x: x_i(0), flat (copied). rank: this agent. exchange: moves the messages (torch.distributed or loopback).
        topology: static, undirected; ``mixing_matrix(0)`` doubly stochastic (e.g. Metropolis weights).
        compressor: C; ``None`` or :class:`Identity` sends the differences uncompressed.
        consensus_step: gamma > 0, or ``"auto"`` (:mod:`~lightning_privdec.algorithms.consensus_step`; 1 uncompressed).
        noise_x, noise_y: d_x, d_y >= 0 (0: no noise). noise_decay: q in (0, 1].
        noise_seed: ``None``: Laplace noise from OS entropy; an int: reproducible from (seed, rank), tests only.
        seed: shared by all agents; keys the compressor's randomness.
    """

    def __init__(
        self, x: Tensor, *, rank: int, topology: Topology, exchange: Exchange, compressor: Compressor | None = None,
        consensus_step: float | str = 1.0, noise_x: float, noise_y: float, noise_decay: float,
        noise_seed: int | None = None, seed: int = 0,
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
        self.rank, self.topology, self.exchange, self.seed = rank, topology, exchange, seed
        self.compressor: Compressor = Identity() if compressor is None else compressor
        self.gamma, self.noise_decay, self.noise_seed = float(consensus_step), float(noise_decay), noise_seed
        self.set_noise(noise_x, noise_y)
        self.generator = node_noise_generator(x.device, noise_seed, rank, stream=NOISE_STREAM)
        self.neighbours = tuple(topology.in_peers(rank, 0))
        self.weights = {j: float(topology.mixing_matrix(0)[rank, j]) for j in self.neighbours}  # w_ij
        self.round = 0
        self.x = x.detach().clone()  # x_i(k), the clean state
        self.u = torch.zeros_like(self.x)  # u_i(k) = y_i(k) - grad f_i(x_i(k)); u_i(0) = 0
        self.y: Tensor | None = None  # y_i(k) and grad f_i(x_i(k)), set by track()
        self._grad: Tensor | None = None
        self.x_copies = {j: torch.zeros_like(self.x) for j in (rank, *self.neighbours)}  # x_j^c(k-1)
        self.y_copies = {j: torch.zeros_like(self.x) for j in (rank, *self.neighbours)}  # y_j^c(k-1)
        self.last_noise: tuple[Tensor, Tensor] | None = None  # (eta_x(k), eta_y(k)) of the last round, diagnostics

    def set_noise(self, noise_x: float, noise_y: float) -> None:
        """d_x and d_y (both >= 0), once they are planned."""
        if not (noise_x >= 0 and noise_y >= 0):
            raise ValueError(f"noise scales must be >= 0, got noise_x={noise_x}, noise_y={noise_y}")
        self.noise_x, self.noise_y = float(noise_x), float(noise_y)

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
        """y_i(k) = u_i(k) + grad f_i(x_i(k)) (eq. (10) with one gradient per round); returns y_i(k)."""
        self._grad = grad.detach().to(self.x.dtype).clone()
        self.y = self.u + self._grad
        return self.y

    def step(self, x_half: Tensor) -> None:
        """One round, lines 5-10, given x_half = x_i(k) - alpha y_i(k) (the caller's descent step)."""
        if self.y is None or self._grad is None:
            raise RuntimeError("CPGTGossip.step needs track(grad f_i(x_i(k))) first, once per round")
        k, d, dtype = self.round, self.dimension, self.x.dtype
        # Lines 5-6 (5)-(6): eta ~ Lap_d(d q^k); x^a = x + eta_x, y^a = y + eta_y
        eta_x = laplace_noise(d, self.noise_x * self.noise_decay**k, self.generator, dtype).to(self.x.device)
        eta_y = laplace_noise(d, self.noise_y * self.noise_decay**k, self.generator, dtype).to(self.x.device)
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
            self._add_to_copies(j, received[j][: len(spec)], received[j][len(spec) :])
        # Line 10 (9): x(k+1) = x^a + gamma sum_j w_ij (x_j^c - x_i^c) - alpha y(k), alpha y(k) = x(k) - x_half
        x_next = x_a + self.gamma * self._consensus(self.x_copies) - (self.x - x_half.to(dtype))
        # Line 10 (10), all but grad f_i(x(k+1)): u(k+1) = y^a + gamma sum_j w_ij (y_j^c - y_i^c) - grad f_i(x(k))
        self.u = y_a + self.gamma * self._consensus(self.y_copies) - self._grad
        self.x, self.y, self._grad = x_next, None, None
        self.last_noise = (eta_x, eta_y)
        self.round += 1

    def _compress(self, difference: Tensor, channel: int) -> list[Tensor]:
        return self.compressor.encode(difference, message_key(self.seed, self.rank, channel, self.round))

    def _add_to_copies(self, j: int, payload_x: list[Tensor], payload_y: list[Tensor]) -> None:
        """x_j^c += C(.), y_j^c += C(.), decoding sender j's payloads with its keys."""
        for copies, payload, channel in ((self.x_copies, payload_x, CHANNEL_X), (self.y_copies, payload_y, CHANNEL_Y)):
            key = message_key(self.seed, j, channel, self.round)
            copies[j].add_(self.compressor.decode(payload, self.dimension, key, dtype=self.x.dtype))

    def _consensus(self, copies: Mapping[int, Tensor]) -> Tensor:
        """sum_j w_ij (c_j - c_i) over the neighbours (the j = i term is zero)."""
        total = torch.zeros_like(self.x)
        for j in self.neighbours:
            total.add_(copies[j] - copies[self.rank], alpha=self.weights[j])
        return total

    def state_dict(self) -> dict[str, Any]:
        """Round, x, u, every replica and the traffic; the noise generator's state only with a fixed
        ``noise_seed`` (a secure generator's key is never saved)."""
        def cpu(tensors: Mapping[int, Tensor]) -> dict[int, Tensor]:
            return {j: t.detach().cpu().clone() for j, t in tensors.items()}

        state: dict[str, Any] = {
            "round": self.round, "x": self.x.detach().cpu().clone(), "u": self.u.detach().cpu().clone(),
            "x_copies": cpu(self.x_copies), "y_copies": cpu(self.y_copies),
            "noise": [self.noise_x, self.noise_y, self.noise_decay], "traffic": self.exchange.traffic.state_dict(),
        }
        if self.noise_seed is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        device, dtype = self.x.device, self.x.dtype
        self.round = int(state["round"])
        self.x = state["x"].to(device=device, dtype=dtype).clone()
        self.u = state["u"].to(device=device, dtype=dtype).clone()
        self.x_copies = {int(j): t.to(device).clone() for j, t in state["x_copies"].items()}
        self.y_copies = {int(j): t.to(device).clone() for j, t in state["y_copies"].items()}
        noise_x, noise_y, self.noise_decay = (float(v) for v in state["noise"])
        self.set_noise(noise_x, noise_y)
        self.y = self._grad = None
        self.exchange.traffic.load_state_dict(state["traffic"])
        if self.noise_seed is not None and "generator" in state:
            self.generator.set_state(state["generator"])
