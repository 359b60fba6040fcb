"""The divergence guard: stop every node when the gossip or the loss grows without bound, instead of training on garbage.

Every ``every_n_steps`` steps each node takes two numbers it already has:

* the **gossip correction** ||x^{t+1} - x^{t+1/2}||, how far the round's mixing moved its numerator: a local
  measure of its distance to consensus (exact gossip moves a node by the disagreement with its in-neighbours;
  compressed gossip, by gamma times its copies' disagreement). Unstable error feedback makes it grow geometrically;
* the **training loss** of the step (non-finite values of a private step's empty Poisson batch are skipped).

The largest values seen in the first ``warmup_checks`` checks are the node's references. The guard fires when a value
is non-finite, or when it stays above ``factor`` (1000) times its reference for ``patience`` checks in a row. The
references have floors so that tiny early values cannot make healthy runs fire: 1 for the loss (a loss that
started below 1 must exceed 1000), and 1e-3 of the model's norm for the correction (the correction must exceed the
whole early model). Healthy runs stay orders of magnitude below both (tests/test_divergence.py).

The nodes decide together: on check steps one all-gather of three numbers per node (no collective on other
steps), so every node raises the same :class:`DivergenceError` at the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["DivergenceError", "DivergenceGuard", "Verdict"]

LOSS, CONSENSUS = 1, 2  # verdict codes, also the order of the all-gathered numbers


class DivergenceError(RuntimeError):
    """Training diverged: the gossip correction or the loss grew without bound (raised on every node at once)."""


@dataclass
class _Tracker:
    """One quantity's reference and its run of checks above ``factor`` x reference."""

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
        return abs(value) / self.reference if self.reference > 0 else 0.0


@dataclass(frozen=True)
class Verdict:
    """A node's finding at one check: which quantity (0: none), its value and its ratio to the reference."""

    code: int = 0
    value: float = 0.0
    ratio: float = 0.0


class DivergenceGuard:
    """Local bookkeeping of the guard (module docstring); the strategy gathers the verdicts and raises.

    Args:
        every_n_steps: steps between checks.
        warmup_checks: checks whose largest values become the references.
        patience: consecutive checks above ``factor`` x reference that make the guard fire.
        factor: the growth that counts as unbounded.
    """

    def __init__(self, every_n_steps: int = 10, warmup_checks: int = 5, patience: int = 3, factor: float = 1e3) -> None:
        if min(every_n_steps, warmup_checks, patience) < 1 or factor <= 1:
            raise ValueError("every_n_steps, warmup_checks and patience must be >= 1 and factor > 1")
        self.every_n_steps, self.warmup_checks, self.patience, self.factor = every_n_steps, warmup_checks, patience, factor
        self.loss = _Tracker(floor=1.0)
        self.consensus = _Tracker()

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
            tracker.run = tracker.run + 1 if ratio > self.factor else 0
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
