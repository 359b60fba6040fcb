"""CPGT: Compressed differentially Private Gradient Tracking (Xie, Yi, Wang, Cao, Ren), Algorithm 1, one agent i:

    1-2   alpha (the SGD learning rate), d_x, d_y, q given or calibrated; x_i(0) given; x_j^c(-1) = y_j^c(-1) = 0
          for j = i and every neighbour; y_i(0) = grad f_i(x_i(0))     :meth:`CPGTNode.configure_optimizer`,
                                                                       :meth:`CPGTNode.plan_noise`, :class:`CPGTGossip`
    3-4   for k = 0..K-1: g_k = grad f_i(x_i(k)), per-sample clipped to C, summed, over qJ, and y_i(k) = u_i(k) + g_k
          into p.grad (eq. (10)'s gradient term, taken at the start of the next round: one gradient per round;
          u_i(0) = 0 gives y_i(0) = g_0); the round recorded      :meth:`CPGTNode.privatize` -> :meth:`CPGTGossip.track`
    5     eta_x ~ Lap_d(d_x q^k),  eta_y ~ Lap_d(d_y q^k)   (this node's own generator)    :meth:`CPGTGossip.step`
    6     x_i^a = x_i(k) + eta_x,  y_i^a = y_i(k) + eta_y                                  (5)-(6)
    7     send C(x_i^a - x_i^c(k-1)) and C(y_i^a - y_i^c(k-1)) to every neighbour   (the only messages)
    8     receive C(x_j^a - x_j^c(k-1)), C(y_j^a - y_j^c(k-1)) from every neighbour j
    9     x_j^c(k) = x_j^c(k-1) + C(.),  y_j^c(k) = y_j^c(k-1) + C(.)   for j = i and every neighbour  (11)-(12)
    10    x_i(k+1) = x_i^a + gamma sum_j w_ij (x_j^c(k) - x_i^c(k)) - alpha y_i(k)                    (9)
          (- alpha y_i(k): the user's plain SGD, lr = alpha, before :meth:`CPGTGossip.step`)
          y_i(k+1) = y_i^a + gamma sum_j w_ij (y_j^c(k) - y_i^c(k)) + grad f_i(x_i(k+1)) - grad f_i(x_i(k))  (10)
          (kept as u_i(k+1) = y_i(k+1) - grad f_i(x_i(k+1)))

W is doubly stochastic on a static undirected graph. With C = identity and gamma = 1 this is DiaDSP (Ding et al.
2021): x_i(k+1) = sum_j w_ij x_j^a - alpha y_i(k), eq. (7). The privacy is pure epsilon-DP of the node's messages
(Theorem 2's coupling; delta = 0), accounted by :class:`~lightning_privdec.privacy.accounting.cpgt.CPGTAccountant`.

The compressor's randomness is keyed by public (seed, sender, channel, round) integers: independent of the data
and of the noise, so compression is post-processing (Theorem 2's proof shares it between the coupled runs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_privdec.algorithms.consensus_step import ConsensusStep, choose_consensus_step
from lightning_privdec.algorithms.mixing import message_key
from lightning_privdec.comm import Exchange, TensorSpec
from lightning_privdec.compression import Compressor, Identity
from lightning_privdec.algorithms.base import PrivateNodeAlgorithm
from lightning_privdec.privacy.accounting.cpgt import (
    CPGTAccountant,
    CPGTOptions,
    LaplaceRelease,
    auto_noise_decay,
    calibrate_cpgt_noise,
    check_theorem2,
    clipping_sensitivity,
    cpgt_epsilon_for,
    laplace_norm_factor,
)
from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.noise import NoiseGenerator, node_noise_generator
from lightning_privdec.tensors import split_like
from lightning_privdec.topology import Topology, TopologyError

__all__ = ["CHANNEL_X", "CHANNEL_Y", "CPGTGossip", "CPGTNode", "CPGTOptions", "laplace_noise"]

CHANNEL_X, CHANNEL_Y = 0, 1  # compressor keys of the two messages of a round
NOISE_STREAM = "cpgt-laplace"


# ---- lines 1-4: the private node -------------------------------------------------------------------------------------
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
    """One CPGT node: clipping without Gaussian noise, gradient tracking, decaying Laplace noise in the gossip."""

    budget_tolerance = 1e-9  # a calibrated scale spends the target exactly, up to float rounding

    def __init__(self, parameters: PrivacyParameters, *, options: CPGTOptions, **kwargs: Any) -> None:
        self.options = options
        super().__init__(parameters, **kwargs)
        self.sampler.batch_size_for_shard = self._batch_size_for_shard
        self.noise_x, self.noise_y = options.noise_x, options.noise_y
        self.lipschitz, self.accounting = float(options.lipschitz), options.accounting  # type: ignore[arg-type]
        # q: given, or "auto" (chosen by configure_optimizer once alpha is known; 1 until then, no noise is drawn)
        self.noise_decay = 1.0 if options.noise_decay == "auto" else float(options.noise_decay)
        self.sensitivity = options.sensitivity
        self.alpha: float | None = None
        self.dimension: int | None = None
        self.norm_factor: float | None = None  # ||v||_1 <= norm_factor ||v|| for the sensitivity's norm
        self.epsilon_theorem2: float | None = None  # the paper's eq. (23), for reference
        self.noise_multiplier = 0.0  # no Gaussian noise: reported as 0 by the budget callback
        self.gossip: CPGTGossip | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    def make_accountant(self) -> CPGTAccountant:
        return CPGTAccountant(self.options.accounting)  # type: ignore[arg-type]

    @property
    def delta(self) -> float:
        return 0.0  # pure epsilon-DP

    @property
    def target_epsilon(self) -> float | None:
        return self.options.target_epsilon

    @property
    def run_epsilon(self) -> float | None:
        return self.ledger.run_epsilon

    def build_gossip(self, x0: Tensor, *, rank: int, topology: Topology, exchange: Exchange,
                     compressor: Compressor | None, seed: int, consensus_step: float | str, **_: Any) -> CPGTGossip:
        """Lines 5-10's state: x, u and the replicas; the Laplace scales are set once planned."""
        self.gossip = CPGTGossip(
            x0, rank=rank, topology=topology, exchange=exchange, compressor=compressor, consensus_step=consensus_step,
            noise_x=0.0, noise_y=0.0, noise_decay=self.noise_decay, noise_seed=self.noise_seed, seed=seed,
        )
        return self.gossip

    def configure_optimizer(self, optimizer: torch.optim.Optimizer, dimension: int) -> None:
        """alpha (plain SGD's learning rate) and d; q if ``noise_decay="auto"``; checks Theorem 2's conditions."""
        self._optimizer = optimizer
        self.alpha, self.dimension = plain_sgd_step_size(optimizer), int(dimension)
        if self.options.noise_decay == "auto":
            if self.accounting == "finite" and self.alpha * self.lipschitz >= 0.5:
                raise PrivacyConfigError(
                    f"CPGT: noise_decay='auto' picks q in Theorem 2's interval, which is empty for alpha L = "
                    f"{self.alpha * self.lipschitz:.4g} >= 1/2; with accounting='finite' pass noise_decay=q explicitly"
                )
            ratio = (1.0, 1.0) if self.noise_x is None else (self.noise_x, self.noise_y)
            self.noise_decay = auto_noise_decay(self.alpha, self.lipschitz, *ratio)  # type: ignore[arg-type]
            if self.gossip is not None:
                self.gossip.noise_decay = self.noise_decay
        if self.accounting != "finite":
            check_theorem2(self.alpha, self.lipschitz, self.noise_decay)

    def _batch_size_for_shard(self, batch_size: int, shard_size: int) -> int:
        """Whole-run accountings need full batches (Assumption 4 fails under mini-batches: the privacy audit,
        docs/audit.md, measures epsilon >= 4.6 against a claimed 2 with q = 0.1); a batch size of at least the shard
        means q = 1 (all of J)."""
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

    # ---- before training: the Laplace scales d_x, d_y ------------------------------------------------------------
    def plan_noise(self, planned_steps: int) -> None:
        """d_x, d_y and the ledger's terms. alpha is read again: a resume restores the checkpoint's learning rate into
        the optimizer after :meth:`configure_optimizer`, and its q (:meth:`load_plan_state`); Theorem 2 is checked
        for the pair the run will use."""
        if self.alpha is None or self.dimension is None:
            raise RuntimeError("CPGTNode.configure_optimizer(...) must run before planning")
        assert self.expected_batch_size is not None
        if self._optimizer is not None:
            self.alpha = plain_sgd_step_size(self._optimizer)
        if self.accounting != "finite":
            check_theorem2(self.alpha, self.lipschitz, self.noise_decay)
        if self.options.sensitivity is None:
            self.sensitivity = clipping_sensitivity(self.parameters.max_grad_norm, self.expected_batch_size)
        self.norm_factor = norm_factor = laplace_norm_factor(self.dimension, self.options.sensitivity_norm)
        common = dict(alpha=self.alpha, lipschitz=self.lipschitz, q=self.noise_decay, sensitivity=self.sensitivity)
        target = self.options.target_epsilon
        if self.noise_x is None:  # calibrate d_x = d_y = d to the target over the plan
            assert target is not None
            self.noise_x = self.noise_y = calibrate_cpgt_noise(
                target, self.accounting, steps=max(1, planned_steps), norm_factor=norm_factor, **common,  # type: ignore[arg-type]
            )
        assert self.noise_y is not None
        self.ledger.configure(noise_x=self.noise_x, noise_y=self.noise_y, norm_factor=norm_factor, **common)  # type: ignore[arg-type]
        if self.accounting != "finite":
            run = self.ledger.run_epsilon
            if target is not None and run > target * (1 + self.budget_tolerance):  # type: ignore[operator]
                raise PrivacyConfigError(
                    f"CPGT: noise_x = {self.noise_x:g}, noise_y = {self.noise_y:g} give epsilon = {run:.4g} "
                    f"({self.accounting} accounting) > target_epsilon = {target:g}; raise the noise scales or the "
                    "budget, or give only target_epsilon to calibrate them"
                )
            self.epsilon_theorem2 = cpgt_epsilon_for(
                "theorem2", steps=None, noise_x=self.noise_x, noise_y=self.noise_y, **common  # type: ignore[arg-type]
            )
        if self.gossip is not None:
            self.gossip.set_noise(self.noise_x, self.noise_y)

    def next_release(self) -> LaplaceRelease | None:
        if self.ledger.terms is None or self.noise_x is None or self.noise_y is None:
            return None
        return LaplaceRelease(self.noise_x, self.noise_y, self.noise_decay)

    # ---- round k ---------------------------------------------------------------------------------------------------
    def privatize(self) -> DPStepStats:
        """g_k = clipped per-sample gradients at x_i(k) summed over qJ, then p.grad <- y_i(k) = u_i(k) + g_k."""
        gossip = self.gossip
        if self.clipping.hooks is None or gossip is None or self.next_release() is None:
            raise RuntimeError("CPGTNode.privatize called before attach(), build_gossip() and private_dataloader()")
        if (gossip.noise_x, gossip.noise_y) != (self.noise_x, self.noise_y):
            raise RuntimeError("CPGT: the Laplace noise was not planned before the first step")
        if gossip.noise_decay != self.noise_decay:
            raise RuntimeError(f"CPGT: the gossip decays its noise by q = {gossip.noise_decay}, the ledger accounts "
                               f"q = {self.noise_decay}")
        if self._optimizer is not None and any(float(g["lr"]) != self.alpha for g in self._optimizer.param_groups):
            raise PrivacyConfigError(
                f"CPGT: the learning rate changed from alpha = {self.alpha} during training; the privacy bound "
                "assumes a constant step size"
            )
        assert self.expected_batch_size is not None
        self.last_step = self.clipping.clipped_mean(self.expected_batch_size)  # g_k; the noise is line 5's Laplace
        params = self.clipping.parameters
        y = gossip.track(torch.cat([p.grad.reshape(-1) for p in params]))
        for p, value in zip(params, split_like(y, params)):
            p.grad.copy_(value)
        return self.last_step

    def noise_summary(self) -> str:
        replayed = self.ledger.steps - self.ledger.rounds
        return (
            f"pure epsilon-DP (delta = 0): Laplace noise d_x = {self.noise_x or 0.0:.4g}, d_y = {self.noise_y or 0.0:.4g} "
            f"decaying by q = {self.noise_decay} per round, {self.accounting} accounting"
            + (f", {replayed} replayed rounds charged" if replayed else "")
        )

    # ---- checkpoints -------------------------------------------------------------------------------------------------
    def plan_state(self) -> dict[str, Any]:
        """The Laplace scales, the adjacency distance and q (chosen at setup when ``noise_decay="auto"``)."""
        return {"noise": [self.noise_x, self.noise_y], "sensitivity": self.sensitivity,
                "noise_decay": self.noise_decay}

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        """Continue the checkpoint's plan: its Laplace scales and its q (Algorithm 1, line 5: round k draws d q^k;
        Theorem 2's bound is for that one q). ``noise_decay="auto"`` keeps the checkpoint's q even if alpha or L
        now give another; an explicit different q is refused."""
        noise_x, noise_y = state["noise"]
        if noise_x is not None:  # a calibrated scale is kept: the run goes on with the noise it has used
            self.noise_x, self.noise_y = float(noise_x), float(noise_y)
        saved, given = float(state["noise_decay"]), self.options.noise_decay
        if given != "auto" and not math.isclose(float(given), saved, rel_tol=1e-12):
            raise PrivacyConfigError(
                f"node {self.rank}: the checkpoint's run decays its Laplace noise by q = {saved!r} per round, this run "
                f"passes noise_decay={given!r}; the noise schedule d q^k and its epsilon hold for one q over the "
                f"whole run. Resume with noise_decay={saved!r} (or 'auto', which keeps the checkpoint's q)"
            )
        self.noise_decay = saved
        if self.gossip is not None:
            self.gossip.noise_decay = saved

    def state_dict(self) -> dict[str, Any]:
        """``steps`` is the trajectory's round ``k`` here, as in CPGT's checkpoints before the ledger had its own state
        (replayed rounds are in the ledger)."""
        return {**super().state_dict(), "steps": self.ledger.rounds}

    def load_accounting_state(self, state: Mapping[str, Any]) -> None:
        """The write-ahead ledger's later state: the trajectory restarts at the checkpoint's round k0 and the rounds
        k0..k1-1 the crashed run released are charged again (:meth:`CPGTAccountant.charge_replay`)."""
        self.ledger.charge_replay(state["ledger"])
        self._certified = None


# ---- lines 5-10: the gossip round ------------------------------------------------------------------------------------
def laplace_noise(
    numel: int, scale: float, generator: NoiseGenerator, dtype: torch.dtype = torch.float64
) -> Tensor:
    """Lap_d(scale): d i.i.d. Laplace(scale) entries from this agent's secret ``generator`` (ChaCha20,
    :meth:`~lightning_privdec.privacy.noise.NoiseGenerator.laplace`), on the generator's device."""
    return generator.laplace(numel, scale, dtype)


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
        """d_x and d_y (both >= 0); the strategy sets them once they are calibrated."""
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

    def debias_is_identity(self) -> bool:
        return True

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
