"""One node's privacy machinery for CPGT: per-sample clipping WITHOUT Gaussian noise, and Theorem 2's pure epsilon.

The Laplace noise of CPGT is added by the algorithm itself (to the state and the tracking variable, Algorithm 1
line 5, :class:`~lightning_privdec.algorithms.cpgt.CPGTGossip`); this engine only bounds how much one example can
move the node's gradient: per-sample gradients clipped to C, summed and divided by the expected batch size q J, so
the adjacency distance of Definition 1 is ``2 C / (q J)`` (q = 1 for full batches). Poisson sampling, the node's
shard and the per-sample machinery are the DP-SGD engine's (:class:`DPCSGPNode`).

Crashes. Theorem 2's coupling charges round k the term ``(alpha a_{k-1} / d_x + a_k / d_y) / q^k`` (times the norm
factor). A run resumed from a checkpoint of round k0 after rounds up to k1 > k0 were released (the write-ahead ledger
says so) sends rounds k0..k1-1 again with fresh noise at the same scales. The two transcripts compose: the coupling
must absorb both, so epsilon = (the run's bound) + (the terms of rounds k0..k1-1). The engine keeps the current
trajectory's round count and the list of replayed intervals; :meth:`epsilon` and the budget check include them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.cpgt import (
    ACCOUNTING,
    calibrate_cpgt_noise,
    check_theorem2,
    clipping_sensitivity,
    cpgt_epsilon_after,
    cpgt_epsilon_for,
    laplace_norm_factor,
)
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE
from lightning_privdec.privacy.errors import PrivacyConfigError


class CPGTPrivacyEngine(DPCSGPNode):
    """Clipping, sampling and CPGT's accounting for one node.

    Args:
        parameters: ``max_grad_norm`` (C) and ``noise_multiplier=0`` (no Gaussian noise); the budget, if any, is
            ``target_epsilon`` here.
        noise_x, noise_y: the Laplace scales d_x, d_y; ``None`` (both) calibrates d_x = d_y to ``target_epsilon``.
        noise_decay: q.
        lipschitz: L, the smoothness constant of the node's (clipped, averaged) gradient: an assumption the user
            makes (see docs/privacy.md).
        sensitivity: the adjacency distance; ``None`` derives 2 C / (q J) from the clipping.
        sensitivity_norm: ``"l2"`` (clipping bounds the l2 norm; the Laplace loss needs l1: a factor sqrt(d)) or
            ``"l1"`` (the sensitivity and L are l1 quantities).
        accounting: ``"sound"`` (default): the whole-run bound of Theorem 2's proof; ``"theorem2"``: the paper's
            eq. (23) verbatim; ``"finite"``: the coupling summed over the steps taken, without Assumption 4.
        target_epsilon: refuse to train when the run's epsilon exceeds it (whole-run accountings), or stop before
            exceeding it (``"finite"``).
    """

    fixed_noise_multiplier = False  # its noise follows its own plan

    def __init__(
        self,
        parameters: PrivacyParameters,
        *,
        rank: int,
        device: torch.device,
        grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE,
        noise_seed: int | None = None,
        noise_x: float | None,
        noise_y: float | None,
        noise_decay: float,
        lipschitz: float,
        sensitivity: float | None = None,
        sensitivity_norm: str = "l2",
        accounting: str = "sound",
        target_epsilon: float | None = None,
    ) -> None:
        super().__init__(parameters, rank=rank, device=device, grad_sample_mode=grad_sample_mode, noise_seed=noise_seed)
        if accounting not in ACCOUNTING:
            raise PrivacyConfigError(f"CPGT: accounting must be one of {ACCOUNTING}, got {accounting!r}")
        self.noise_x, self.noise_y = noise_x, noise_y
        self.noise_decay, self.lipschitz = noise_decay, lipschitz
        self.sensitivity_given, self.sensitivity = sensitivity, sensitivity
        self.sensitivity_norm, self.accounting = sensitivity_norm, accounting
        self.target_epsilon = target_epsilon
        self.alpha: float | None = None
        self.dimension: int | None = None
        self.norm_factor: float | None = None
        self.run_epsilon: float | None = None  # the whole-run bound (sound or theorem2 accountings)
        self.epsilon_theorem2: float | None = None  # the paper's eq. (23), for reference
        self.noise_multiplier = 0.0  # no Gaussian noise: reported as 0 by the budget callback
        self._steps = 0  # rounds of the current trajectory (= the algorithm's round counter)
        self._replayed: list[tuple[int, int]] = []  # [k0, k1): rounds released again after a resume

    def configure(self, *, step_size: float, dimension: int) -> None:
        """alpha (the SGD learning rate) and d (the number of trainable parameters); checks Theorem 2's conditions."""
        self.alpha, self.dimension = float(step_size), int(dimension)
        self.norm_factor = laplace_norm_factor(self.dimension, self.sensitivity_norm)
        if self.accounting != "finite":
            check_theorem2(self.alpha, self.lipschitz, self.noise_decay)

    # ---- planning ------------------------------------------------------------------------------------------------
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
        if self.alpha is None or self.norm_factor is None:
            raise RuntimeError("CPGTPrivacyEngine.configure(step_size=..., dimension=...) must run before planning")
        assert self.expected_batch_size is not None
        self.noise_multiplier = 0.0
        self.planned_steps = planned_steps
        if self.sensitivity_given is None:
            self.sensitivity = clipping_sensitivity(self.parameters.max_grad_norm, self.expected_batch_size)
        common = dict(alpha=self.alpha, lipschitz=self.lipschitz, q=self.noise_decay, sensitivity=self.sensitivity)
        if self.noise_x is None:  # calibrate d_x = d_y = d to the target over the plan
            assert self.target_epsilon is not None
            d = calibrate_cpgt_noise(
                self.target_epsilon, self.accounting, steps=max(1, planned_steps), norm_factor=self.norm_factor,
                **common,  # type: ignore[arg-type]
            )
            self.noise_x = self.noise_y = d
        assert self.noise_y is not None
        if self.accounting != "finite":
            self.run_epsilon = self._epsilon_after(None)
            if self.target_epsilon is not None and self.run_epsilon > self.target_epsilon * (1 + 1e-9):
                raise PrivacyConfigError(
                    f"CPGT: noise_x = {self.noise_x:g}, noise_y = {self.noise_y:g} give epsilon = "
                    f"{self.run_epsilon:.4g} ({self.accounting} accounting) > target_epsilon = "
                    f"{self.target_epsilon:g}; "
                    "raise the noise scales or the budget, or give only target_epsilon to calibrate them"
                )
            self.epsilon_theorem2 = cpgt_epsilon_for(
                "theorem2", steps=None, noise_x=self.noise_x, noise_y=self.noise_y, **common  # type: ignore[arg-type]
            )

    def _epsilon_after(self, steps: int | None) -> float:
        """The accounting's epsilon of rounds 0..steps-1 of one trajectory (``None``: the whole run)."""
        assert self.alpha is not None and self.noise_x is not None and self.noise_y is not None
        assert self.sensitivity is not None and self.norm_factor is not None
        return cpgt_epsilon_for(
            self.accounting,  # type: ignore[arg-type]
            steps=steps, alpha=self.alpha, lipschitz=self.lipschitz, q=self.noise_decay, noise_x=self.noise_x,
            noise_y=self.noise_y, sensitivity=self.sensitivity, norm_factor=self._norm_factor(),
        )

    def _norm_factor(self) -> float:
        assert self.norm_factor is not None
        return 1.0 if self.accounting == "theorem2" else self.norm_factor

    def _rounds_epsilon(self, rounds: int) -> float:
        """The coupling's terms of rounds 0..rounds-1 summed (Assumption 4 unless ``accounting="finite"``)."""
        assert self.alpha is not None and self.noise_x is not None and self.noise_y is not None
        assert self.sensitivity is not None
        return cpgt_epsilon_after(
            rounds, alpha=self.alpha, lipschitz=self.lipschitz, q=self.noise_decay, noise_x=self.noise_x,
            noise_y=self.noise_y, sensitivity=self.sensitivity, norm_factor=self._norm_factor(),
            linear_difference=self.accounting != "finite",
        )

    def _replay_epsilon(self) -> float:
        """What the rounds released twice add by composition: their terms, once more per replay."""
        return sum(self._rounds_epsilon(end) - self._rounds_epsilon(start) for start, end in self._replayed)

    # ---- the step: clipping only (the Laplace noise is the algorithm's) ------------------------------------------
    def privatize(self) -> DPStepStats:
        """p.grad <- sum of per-sample gradients clipped to C, divided by q J: the node's gradient g_k."""
        if self.per_sample is None and self.ghost is None:
            raise RuntimeError("CPGTPrivacyEngine.privatize called before attach() and private_dataloader()")
        assert self.expected_batch_size is not None
        self.last_step = self.clip_and_noise(self.parameters.max_grad_norm, noise_multiplier=0.0)
        self._steps += 1
        return self.last_step

    # ---- accounting ----------------------------------------------------------------------------------------------
    @property
    def delta(self) -> float:
        return 0.0  # pure epsilon-DP

    def noise_summary(self) -> str:
        replayed = f", {sum(b - a for a, b in self._replayed)} replayed rounds charged" if self._replayed else ""
        return (
            f"pure epsilon-DP (delta = 0): Laplace noise d_x = {self.noise_x or 0.0:.4g}, d_y = {self.noise_y or 0.0:.4g} "
            f"decaying by q = {self.noise_decay} per round, {self.accounting} accounting{replayed}"
        )

    @property
    def steps(self) -> int:
        """Rounds released in all: the current trajectory's and every replayed one."""
        return self._steps + sum(end - start for start, end in self._replayed)

    def epsilon(self) -> float:
        """Epsilon spent: 0 before the first message; then the whole-run bound (it covers every round of the
        trajectory, past and future), or with ``accounting="finite"`` the bound of the rounds taken so far; plus,
        by composition, the rounds a resume released again."""
        if self.steps == 0 or self.noise_x is None:
            return 0.0
        trajectory = self.run_epsilon if self.run_epsilon is not None else self._epsilon_after(self._steps)
        return trajectory + self._replay_epsilon()

    def next_step_exceeds_budget(self) -> bool:
        if self.target_epsilon is None or self.noise_x is None:
            return False
        if self.accounting != "finite":  # the next round is covered by the run's bound; replays may not be
            return self.run_epsilon + self._replay_epsilon() > self.target_epsilon * (1 + 1e-9)  # type: ignore[operator]
        # the calibrated scale spends the target exactly, up to float rounding
        return self._epsilon_after(self._steps + 1) + self._replay_epsilon() > self.target_epsilon * (1 + 1e-9)

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self._steps,
            "replayed": [[start, end] for start, end in self._replayed],
            "noise": [self.noise_x, self.noise_y],
            "sensitivity": self.sensitivity,
            **self.generator_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        replayed = [(int(start), int(end)) for start, end in state.get("replayed", [])]
        released = int(state["steps"]) + sum(end - start for start, end in replayed)
        if released < self.steps:
            raise PrivacyConfigError(
                f"node {self.rank}: the checkpoint has {released} released CPGT rounds but this node has already "
                f"released {self.steps}; restoring it would forget spent privacy. Resume into a fresh Trainer."
            )
        self._steps, self._replayed = int(state["steps"]), replayed
        noise_x, noise_y = state["noise"]
        if noise_x is not None:  # a calibrated scale is kept: the run goes on with the noise it has used
            self.noise_x, self.noise_y = float(noise_x), float(noise_y)
        self.load_generator_state(state)

    def load_accounting_state(self, state: Mapping[str, Any]) -> None:
        """Take the write-ahead ledger's later state of this run: the trajectory restarts at the checkpoint's round
        k0 (the algorithm's round counter), and the rounds k0..k1-1 the crashed run had released are recorded as
        replayed, so they are charged again as the resumed run re-sends them."""
        released_round = int(state["steps"])
        replayed = [(int(start), int(end)) for start, end in state.get("replayed", [])]
        if released_round > self._steps:
            replayed.append((self._steps, released_round))
        self._replayed = replayed
