"""The divergence guard: stop every node when the gossip or the loss grows without bound, instead of training on garbage.

Every ``every_n_steps`` steps each node takes two numbers it already has:

* the **gossip correction** ||x^{t+1} - x^{t+1/2}||, how far the round's mixing moved its numerator: a local
  measure of its distance to consensus (exact gossip moves a node by the disagreement with its in-neighbours;
  compressed gossip, by gamma times its copies' disagreement). Unstable error feedback makes it grow geometrically;
* the **training loss** of the step (non-finite values of a private step's empty Poisson batch are skipped).

The values at the first check (step 10) are the node's references. The guard fires when a value is non-finite, or
when it stays above its factor times its reference for ``patience`` (3) checks in a row: 1000 for the correction
(unbounded growth), 10 for the loss (a training loss ten times its early value, which for a classifier is about
chance level, is garbage; a loss that falls below zero, like a density's negative log-likelihood, never fires). The
references have floors so that tiny early values cannot make healthy runs fire: 1 for the loss (a loss that started
below 1 must exceed 10), and 1e-3 of the model's norm for the correction (the correction must exceed the whole early
model).

Measured on the digits quick start (4 nodes, every step): in healthy runs (DP-CSGP with RandK(0.5) and push-sum with
RandK(0.1), automatic consensus step) the correction stays within 0.5-3x its step-10 value and the loss below its
early value. Unstable error feedback (push-sum, RandK(0.1), consensus_step=1) multiplies the correction by about 4.5
every 10 steps: the guard stops it near step 80. DP-CSGP with RandK(0.5) and consensus_step=1 (5-15% accuracy)
keeps the loss at 10-80x its early value from step 110 on: the guard stops it at step 130.

The nodes decide together: on check steps one all-gather of three numbers per node (no collective on other
steps), so every node raises the same :class:`DivergenceError` at the same step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_privdec.strategies.checks import gather_tensors

__all__ = ["DivergenceError", "DivergenceGuard", "Verdict", "likely_cause"]

LOSS, CONSENSUS = 1, 2  # verdict codes, also the order of the all-gathered numbers


class DivergenceError(RuntimeError):
    """Training diverged: the gossip correction or the loss grew without bound (raised on every node at once)."""


@dataclass
class _Tracker:
    """One quantity's reference and its run of checks above ``factor`` x reference."""

    factor: float
    floor: float = 0.0
    seen: list[float] = field(default_factory=list)
    reference: float | None = None
    run: int = 0

    def ratio(self, value: float, warmup_checks: int) -> float:
        """value / reference (inf when non-finite; 0 while the reference forms)."""
        if not math.isfinite(value):
            return math.inf
        if self.reference is None:
            self.seen.append(abs(value))
            if len(self.seen) >= warmup_checks:
                self.reference = max(max(self.seen), self.floor)
            return 0.0
        return value / self.reference if self.reference > 0 else 0.0


@dataclass(frozen=True)
class Verdict:
    """A node's finding at one check: which quantity (0: none), its value and its ratio to the reference."""

    code: int = 0
    value: float = 0.0
    ratio: float = 0.0


class DivergenceGuard:
    """The guard of one node (module docstring): its bookkeeping, and :meth:`check`, which every node runs alike.

    Args:
        every_n_steps: steps between checks.
        warmup_checks: checks whose largest values become the references (1: the first check's values).
        patience: consecutive checks above factor x reference that make the guard fire.
        consensus_factor, loss_factor: the growth of the gossip correction and of the loss that counts as divergence.
    """

    def __init__(
        self, every_n_steps: int = 10, warmup_checks: int = 1, patience: int = 3, consensus_factor: float = 1e3,
        loss_factor: float = 10.0,
    ) -> None:
        if min(every_n_steps, warmup_checks, patience) < 1 or min(consensus_factor, loss_factor) <= 1:
            raise ValueError("every_n_steps, warmup_checks and patience must be >= 1 and the factors > 1")
        self.every_n_steps, self.warmup_checks, self.patience = every_n_steps, warmup_checks, patience
        self.loss = _Tracker(loss_factor, floor=1.0)
        self.consensus = _Tracker(consensus_factor)

    def due(self, round_: int) -> bool:
        """Whether the step that completed gossip round ``round_`` (counted from 1) is a check step."""
        return round_ % self.every_n_steps == 0

    def observe(self, loss: float | None, correction: float, model_norm: float) -> Verdict:
        """Record one check's loss (None: skipped), gossip correction and model norm; return this node's verdict."""
        if self.consensus.reference is None:
            self.consensus.floor = max(self.consensus.floor, 1e-3 * model_norm)
        verdict = Verdict()
        for code, tracker, value in ((CONSENSUS, self.consensus, correction), (LOSS, self.loss, loss)):
            if value is None:
                continue
            ratio = tracker.ratio(value, self.warmup_checks)
            tracker.run = tracker.run + 1 if ratio > tracker.factor else 0
            if not verdict.code and (math.isinf(ratio) or tracker.run >= self.patience):
                verdict = Verdict(code, value, ratio)
        return verdict

    def message(self, rank: int, step: int, verdict: Verdict, cause: str) -> str:
        """The error every node raises for node ``rank``'s verdict; ``cause`` names the settings to change."""
        what = "gossip correction (its distance to consensus)" if verdict.code == CONSENSUS else "training loss"
        if math.isinf(verdict.ratio):
            grown = f"became {verdict.value}"
        else:
            grown = (f"grew to {verdict.value:.3g}, {verdict.ratio:.3g} x its early value, for {self.patience} checks "
                     f"in a row (one every {self.every_n_steps} steps)")
        return (
            f"training diverged: at step {step} node {rank}'s {what} {grown}. Every node stops here instead of "
            f"training on garbage. {cause} Fix it and restart (or resume from a checkpoint taken before the growth)."
        )

    def check(
        self, loss: Any, correction: float, model_norm: float, *, step: int, device: torch.device,
        cause: Callable[[], str], skip_nonfinite_loss: bool = False,
    ) -> None:
        """A check step (every node at once): this node's verdict on ``loss`` (a tensor; with
        ``skip_nonfinite_loss`` a non-finite one is not judged: a private step's empty Poisson batch), ``correction``
        and ``model_norm``, one all-gather of every node's, and :class:`DivergenceError` on every node if one fired
        (``cause()``: the settings most likely behind it)."""
        value = loss.detach().reshape(-1)[0].item() if isinstance(loss, torch.Tensor) and loss.numel() else None
        if value is not None and not math.isfinite(value) and skip_nonfinite_loss:
            value = None
        verdict = self.observe(value, correction, model_norm)
        local = torch.tensor([verdict.code, verdict.value, verdict.ratio], dtype=torch.float64, device=device)
        verdicts = gather_tensors(local).cpu()
        fired = [r for r in range(len(verdicts)) if verdicts[r, 0] > 0]
        if fired:
            rank = fired[0]
            code, value, ratio = int(verdicts[rank, 0]), float(verdicts[rank, 1]), float(verdicts[rank, 2])
            raise DivergenceError(self.message(rank, step, Verdict(code, value, ratio), cause()))


def likely_cause(lrs: Sequence[float], compressor: Any, gamma: float, auto_gamma: float | None) -> str:
    """The settings most likely behind a divergence, for its error message: the learning rates ``lrs``, or with a
    compressor its consensus step ``gamma`` when above ``auto_gamma`` (what ``consensus_step="auto"`` chooses)."""
    lr = ", ".join(f"{lr:g}" for lr in lrs) or "?"
    if compressor is None:
        return f"Likely cause: the learning rate (lr={lr}) is too large for this model and noise."
    assert auto_gamma is not None
    if gamma > auto_gamma * (1 + 1e-9):
        return (
            f"Likely cause: consensus_step={gamma:.3g} is too large for compressor={compressor} on this graph "
            f"(consensus_step='auto' chooses {auto_gamma:.3g}); otherwise the learning rate (lr={lr}) is too large."
        )
    return (
        f"Likely cause: the learning rate (lr={lr}) is too large for this model and noise, or compressor="
        f"{compressor} too aggressive at consensus_step={gamma:.3g}: lower one of them."
    )
