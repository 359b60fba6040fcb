"""Pure epsilon-DP of CPGT (Xie, Yi, Wang, Cao, Ren: "Compressed Differentially Private Distributed Optimization with
Linear Convergence"), Theorem 2, and a sound re-derivation of it.

Setting (the paper's Assumptions 1 and 4 and Definition 1): every f_i is L-smooth; two function sets are adjacent when
one agent's function changes from f to f' with ``max_x ||grad f'(x) - grad f(x)|| <= sensitivity`` (the paper's
"delta": an adjacency distance, NOT the delta of (epsilon, delta)-DP; CPGT is pure epsilon-DP, delta = 0), and the
two differ by a linear term, so ``grad f' - grad f = c`` is constant (Assumption 4). Agent i adds Laplace noise of
scales ``noise_x q^k`` to its state and ``noise_y q^k`` to its tracking variable at round k (Algorithm 1, line 5).

The proof (Appendix C, via Ding et al. 2021, Thm. 5) couples the two runs so that every message is identical: the
noise absorbs the state differences, Delta_x(k) = -alpha Delta_y(k-1) and
Delta_y(k+1) = grad f(x'(k+1)) - grad f(x(k+1)) - (grad f(x'(k)) - grad f(x(k))), Delta_y(0) = c.
With a_k >= ||Delta_y(k)||:

    a_0 = sensitivity,  a_{k+1} <= alpha L (a_k + a_{k-1})                                      (a_{-1} = 0)
    epsilon = sum_k ||Delta_x(k)||_1 / (noise_x q^k) + ||Delta_y(k)||_1 / (noise_y q^k)      (Laplace density ratio)

Summing the recursion gives S = sum_k a_k / q^k = q^2 delta / (q^2 - alpha L - q alpha L), finite exactly when
q > (alpha L + sqrt(alpha^2 L^2 + 4 alpha L)) / 2 (the growth rate of a_k), and

    epsilon = (alpha / (q noise_x) + 1 / noise_y) * S                                       (:func:`cpgt_epsilon`)

whereas the paper's eq. (23) writes tau = alpha / noise_x + 1 / noise_y (:func:`theorem2_epsilon`): Delta_x(k) is
absorbed by the noise of round k, whose scale is noise_x q^k, while it is bounded by a_{k-1}, one round older, so
the x-part carries 1/q. The recursion is tight (a scalar quadratic attains it), so eq. (23) understates the proof's
bound by that factor. Second, the Laplace density ratio is governed by l1 norms while the paper's norms are l2: with
an l2 sensitivity and an l2 smoothness constant, ||v||_1 <= sqrt(d) ||v||_2 multiplies epsilon by sqrt(d)
(``norm_factor``); with l1 quantities (an l1 sensitivity and L for the l1 norm) the factor is 1.

:func:`cpgt_epsilon_after` sums the same coupling over a finite number of rounds, and optionally without
Assumption 4 (then the change of the gradient difference adds up to 2 * sensitivity per round): the only bound that
applies to non-convex models trained with clipped gradients, for which Assumption 4 does not hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_privdec.privacy.accounting.base import Accountant, golden_section_min
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.validation import check_positive

__all__ = [
    "ACCOUNTING",
    "CPGTAccountant",
    "CPGTOptions",
    "LaplaceRelease",
    "calibrate_cpgt_noise",
    "auto_noise_decay",
    "check_theorem2",
    "clipping_sensitivity",
    "cpgt_epsilon",
    "cpgt_epsilon_after",
    "cpgt_epsilon_for",
    "min_noise_decay",
    "tracker_noise_offset",
    "laplace_norm_factor",
    "theorem2_epsilon",
]

#: how a CPGT run is accounted: the sound closed form, the paper's eq. (23) verbatim, or the finite-horizon coupling
#: without Assumption 4
ACCOUNTING = ("sound", "theorem2", "finite")
Accounting = Literal["sound", "theorem2", "finite"]


def _positive(value: Any, name: str) -> float:
    return check_positive(value, name, where="CPGT: ")


def min_noise_decay(alpha: float, lipschitz: float) -> float:
    """(alpha L + sqrt(alpha^2 L^2 + 4 alpha L)) / 2: the growth rate of the coupling's shifts; q must exceed it."""
    al = alpha * lipschitz
    return (al + math.sqrt(al * al + 4.0 * al)) / 2.0


def check_theorem2(alpha: float, lipschitz: float, q: float) -> None:
    """Theorem 2's conditions: alpha < 1/(2L) and q in ((alpha L + sqrt(alpha^2 L^2 + 4 alpha L)) / 2, 1).

    Raises :class:`PrivacyConfigError` naming the violated condition, its numbers, and how to fix it.
    """
    alpha = _positive(alpha, "the step size alpha (the SGD learning rate)")
    lipschitz = _positive(lipschitz, "the smoothness constant L (lipschitz)")
    q = _positive(q, "the noise decay rate q (noise_decay)")
    if alpha * lipschitz >= 0.5:
        raise PrivacyConfigError(
            f"CPGT Theorem 2 needs alpha < 1/(2L): alpha = {alpha:g} and L = {lipschitz:g} give alpha L = "
            f"{alpha * lipschitz:.4g} >= 0.5. Use a step size alpha (the SGD learning rate) below "
            f"{0.5 / lipschitz:.4g}."
        )
    low = min_noise_decay(alpha, lipschitz)
    if not low < q < 1.0:
        raise PrivacyConfigError(
            f"CPGT Theorem 2 needs the noise decay q in ((alpha L + sqrt(alpha^2 L^2 + 4 alpha L)) / 2, 1) = "
            f"({low:.4g}, 1) for alpha = {alpha:g}, L = {lipschitz:g}; got q = {q:g}. "
            + (
                f"Choose q (noise_decay) between {low:.4g} and 1."
                if low < 1.0
                else "No q < 1 works: lower the step size alpha."
            )
        )


def auto_noise_decay(alpha: float, lipschitz: float, noise_x: float = 1.0, noise_y: float = 1.0) -> float:
    """``noise_decay="auto"``: the q in Theorem 2's interval that minimises epsilon x the fixed point's offset.

    The tracker keeps the sum of every round's y-noise forever, sum_i grad f_i(x^inf) = -sum_i sum_k eta_y_i(k)
    (Remark 2): per coordinate that sum has standard deviation noise_y sqrt(2 / (1 - q^2)), which grows with q, while
    the sound epsilon, (alpha / (q noise_x) + 1 / noise_y) q^2 delta / (q^2 - alpha L - q alpha L) (Theorem 2's proof,
    :func:`cpgt_epsilon`), falls with q. With both scales calibrated to a budget (noise_x = noise_y = d, epsilon
    proportional to 1/d), minimising their product over q minimises the offset at that epsilon; the minimiser depends
    on alpha, L and the ratio noise_x / noise_y only (alpha = 0.5, L = 0.1: q = 0.666).
    """
    alpha = _positive(alpha, "the step size alpha (the SGD learning rate)")
    lipschitz = _positive(lipschitz, "the smoothness constant L (lipschitz)")
    d_x, d_y = _positive(noise_x, "noise_x"), _positive(noise_y, "noise_y")
    al = alpha * lipschitz
    if al >= 0.5:
        check_theorem2(alpha, lipschitz, 0.5)  # raises, naming alpha < 1/(2L)
    low = min_noise_decay(alpha, lipschitz)  # < 1 when alpha L < 1/2

    def log_product(q: float) -> float:  # log of epsilon(q) x offset(q), up to constants
        return (math.log(alpha / (q * d_x) + 1.0 / d_y) + 2.0 * math.log(q) - math.log(q * q - al - q * al)
                - 0.5 * math.log1p(-q * q))

    # unimodal on (low, 1), +inf at both ends: a golden-section search on the open interval
    return golden_section_min(log_product, low + 1e-9 * (1.0 - low), 1.0 - 1e-9 * (1.0 - low), tol=1e-8, iters=200)


def tracker_noise_offset(noise_y: float, q: float, dimension: int, nodes: int) -> float:
    """The expected norm of the network's mean accumulated tracker noise, ||(1/n) sum_i sum_k eta_y_i(k)||.

    The trackers never shed it: 1^T y(k) = 1^T grad f(x(k)) + sum_{t<k} 1^T eta_y(t), so a fixed point needs
    (1/n) sum_i grad f_i(x^inf) = -(1/n) sum_i sum_k eta_y_i(k) (Remark 2). Each coordinate of a node's sum has
    variance 2 noise_y^2 / (1 - q^2) (Laplace(b) has variance 2 b^2), so the mean over n nodes has expected norm about
    noise_y sqrt(2 d / ((1 - q^2) n)). Clipped per-sample gradients bound the mean gradient by C: above C no fixed
    point exists and the iterates drift without bound.
    """
    q = _positive(q, "the noise decay rate q")
    if q >= 1.0:
        return math.inf
    return noise_y * math.sqrt(2.0 * dimension / ((1.0 - q * q) * nodes))


def _series(alpha: float, lipschitz: float, q: float, sensitivity: float) -> float:
    """S = sum_k a_k / q^k = q^2 delta / (q^2 - alpha L - q alpha L) for the coupling's recursion."""
    al = alpha * lipschitz
    return q * q * sensitivity / (q * q - al - q * al)


def theorem2_epsilon(
    *, alpha: float, lipschitz: float, q: float, noise_x: float, noise_y: float, sensitivity: float
) -> float:
    """The paper's eq. (23), verbatim: tau q^2 delta / (q^2 - alpha L - q alpha L), tau = alpha/d_x + 1/d_y.

    Kept for comparison with the paper; it understates the bound its proof gives (see :func:`cpgt_epsilon`).
    """
    check_theorem2(alpha, lipschitz, q)
    tau = alpha / _positive(noise_x, "noise_x") + 1.0 / _positive(noise_y, "noise_y")
    return tau * _series(alpha, lipschitz, q, _positive(sensitivity, "the sensitivity (adjacency distance)"))


def cpgt_epsilon(
    *,
    alpha: float,
    lipschitz: float,
    q: float,
    noise_x: float,
    noise_y: float,
    sensitivity: float,
    norm_factor: float = 1.0,
) -> float:
    """Epsilon of the whole (infinite) CPGT run under Assumptions 1 and 4: the proof of Theorem 2 carried out.

    ``norm_factor * (alpha / (q noise_x) + 1 / noise_y) * q^2 delta / (q^2 - alpha L - q alpha L)``;
    ``norm_factor`` is sqrt(d) for an l2 sensitivity and l2 smoothness constant, 1 for l1 ones
    (:func:`laplace_norm_factor`).
    """
    check_theorem2(alpha, lipschitz, q)
    tau = alpha / (q * _positive(noise_x, "noise_x")) + 1.0 / _positive(noise_y, "noise_y")
    series = _series(alpha, lipschitz, q, _positive(sensitivity, "the sensitivity (adjacency distance)"))
    return _positive(norm_factor, "norm_factor") * tau * series


def cpgt_epsilon_after(
    steps: int,
    *,
    alpha: float,
    lipschitz: float,
    q: float,
    noise_x: float,
    noise_y: float,
    sensitivity: float,
    norm_factor: float = 1.0,
    linear_difference: bool = True,
) -> float:
    """Epsilon of the first ``steps`` rounds of CPGT from the coupling of Theorem 2's proof, summed numerically.

    Needs no condition on alpha or q (finitely many rounds). With ``linear_difference=True`` (Assumption 4) it
    increases to :func:`cpgt_epsilon` as ``steps`` grows; with ``False`` the gradient difference may change between
    rounds (clipped gradients of a neural network), which adds 2 * sensitivity to the recursion every round.
    Returns ``math.inf`` when the bound overflows.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise PrivacyConfigError(f"CPGT: steps must be an integer >= 0, got {steps!r}")
    alpha = _positive(alpha, "the step size alpha")
    al = alpha * _positive(lipschitz, "the smoothness constant L")
    q = _positive(q, "the noise decay rate q")
    if q > 1.0:
        raise PrivacyConfigError(f"CPGT: the noise decay rate q must be <= 1, got {q}")
    d_x, d_y = _positive(noise_x, "noise_x"), _positive(noise_y, "noise_y")
    delta = _positive(sensitivity, "the sensitivity (adjacency distance)")
    drift = 0.0 if linear_difference else 2.0 * delta
    if steps == 0:
        return 0.0
    epsilon = delta / d_y  # round 0: Delta_x(0) = 0, ||Delta_y(0)|| <= delta
    a_older, a_last = 0.0, delta  # bounds on ||Delta_y(k-2)||, ||Delta_y(k-1)||
    log_q = math.log(q)
    for k in range(1, steps):
        a_k = al * (a_last + a_older) + drift
        try:
            epsilon += (alpha * a_last / d_x + a_k / d_y) * math.exp(-k * log_q)
        except OverflowError:
            return math.inf
        if not math.isfinite(epsilon):
            return math.inf
        a_older, a_last = a_last, a_k
    return _positive(norm_factor, "norm_factor") * epsilon


def laplace_norm_factor(dimension: int, norm: str = "l2") -> float:
    """sqrt(d) when the sensitivity and L are l2 quantities (the Laplace loss is an l1 norm), 1 for l1 quantities."""
    if norm == "l1":
        return 1.0
    if norm != "l2":
        raise PrivacyConfigError(f"CPGT: sensitivity_norm must be 'l2' or 'l1', got {norm!r}")
    if isinstance(dimension, bool) or not isinstance(dimension, int) or dimension < 1:
        raise PrivacyConfigError(f"CPGT: the dimension must be a positive integer, got {dimension!r}")
    return math.sqrt(dimension)


def clipping_sensitivity(max_grad_norm: float, expected_batch_size: float) -> float:
    """2 C / (q J): how far one replaced example can move a node's clipped, averaged gradient (l2).

    Per-sample gradients are clipped to C and their sum is divided by the expected batch size q J (J for full
    batches), so replacing one example changes the average by at most 2 C / (q J) at any point x.
    """
    return 2.0 * _positive(max_grad_norm, "max_grad_norm") / _positive(expected_batch_size, "expected_batch_size")


def cpgt_epsilon_for(
    accounting: Accounting,
    *,
    steps: int | None,
    alpha: float,
    lipschitz: float,
    q: float,
    noise_x: float,
    noise_y: float,
    sensitivity: float,
    norm_factor: float = 1.0,
) -> float:
    """Epsilon by the chosen accounting: ``"sound"`` and ``"theorem2"`` cover the whole run (``steps`` unused),
    ``"finite"`` covers ``steps`` rounds without Assumption 4."""
    common = dict(alpha=alpha, lipschitz=lipschitz, q=q, noise_x=noise_x, noise_y=noise_y, sensitivity=sensitivity)
    if accounting == "sound":
        return cpgt_epsilon(**common, norm_factor=norm_factor)
    if accounting == "theorem2":
        return theorem2_epsilon(**common)
    if accounting == "finite":
        if steps is None:
            raise PrivacyConfigError("CPGT: accounting='finite' needs the number of steps")
        return cpgt_epsilon_after(steps, **common, norm_factor=norm_factor, linear_difference=False)
    raise PrivacyConfigError(f"CPGT: accounting must be one of {ACCOUNTING}, got {accounting!r}")


def calibrate_cpgt_noise(
    target_epsilon: float,
    accounting: Accounting,
    *,
    steps: int | None,
    alpha: float,
    lipschitz: float,
    q: float,
    sensitivity: float,
    norm_factor: float = 1.0,
) -> float:
    """The noise scale d = noise_x = noise_y that spends exactly ``target_epsilon`` (every bound is proportional to
    1/d when both scales are d, so this is a division, not a search)."""
    target = _positive(target_epsilon, "target_epsilon")
    at_one = cpgt_epsilon_for(
        accounting, steps=steps, alpha=alpha, lipschitz=lipschitz, q=q, noise_x=1.0, noise_y=1.0,
        sensitivity=sensitivity, norm_factor=norm_factor,
    )
    if not math.isfinite(at_one):
        raise PrivacyConfigError(
            f"CPGT: the finite-horizon bound overflows for {steps} steps at q = {q:g}: no noise level reaches "
            f"target_epsilon = {target:g}; use fewer steps or a decay rate q closer to 1"
        )
    return at_one / target


@dataclass(frozen=True)
class LaplaceRelease:
    """One CPGT round: Laplace noise of scales d_x, d_y on the tracked variables, decaying by q per round (the terms
    the accountant was configured with: a round released at other scales is refused when recorded)."""

    noise_x: float
    noise_y: float
    noise_decay: float

    def __post_init__(self) -> None:
        for name in ("noise_x", "noise_y"):
            object.__setattr__(self, name, _positive(getattr(self, name), name))
        q = self.noise_decay
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < float(q) <= 1.0:
            raise PrivacyConfigError(f"noise_decay (CPGT's q) must lie in (0, 1], got {q!r}")
        object.__setattr__(self, "noise_decay", float(q))


class CPGTAccountant(Accountant):
    """One CPGT node's pure epsilon-DP ledger (delta = 0): the rounds it released and the rounds a resume released
    again.

    Epsilon: 0 before the first message; then the whole-run bound (``"sound"``, ``"theorem2"``: it covers every
    round of the trajectory, past and future), or the coupling of the rounds taken so far (``"finite"``); plus, by
    composition, the terms of every replayed round. A release is one round (:class:`LaplaceRelease`). The bound's terms (alpha,
    L, q, the Laplace scales, the sensitivity, the norm factor) are set by :meth:`configure` once the noise is planned,
    and kept in the ledger's state: a checkpoint's ledger tells its epsilon before the resumed run plans its noise
    (the write-ahead ledger's resume warning is printed then).

    Crashes: a run resumed from a checkpoint of round k0 after rounds up to k1 > k0 were released (the write-ahead
    ledger says so) sends rounds k0..k1-1 again with fresh noise at the same scales; the two transcripts compose, so
    :meth:`charge_replay` adds the terms of rounds k0..k1-1 (Theorem 2's coupling must absorb both).
    """

    delta = 0.0

    def __init__(self, accounting: Accounting) -> None:
        if accounting not in ACCOUNTING:
            raise PrivacyConfigError(f"CPGT: accounting must be one of {ACCOUNTING}, got {accounting!r}")
        self.accounting = accounting
        self.rounds = 0  # rounds of the current trajectory (the algorithm's round counter)
        self.replayed: list[tuple[int, int]] = []  # [k0, k1): rounds released again after a resume
        self.terms: dict[str, float] | None = None
        self.run_epsilon: float | None = None  # the whole-run bound (sound or theorem2 accountings)

    def configure(
        self, *, alpha: float, lipschitz: float, q: float, noise_x: float, noise_y: float, sensitivity: float,
        norm_factor: float,
    ) -> None:
        """The bound's terms; eq. (23) (``"theorem2"``) is the paper's, verbatim, without the l1 norm factor."""
        self.terms = dict(alpha=alpha, lipschitz=lipschitz, q=q, noise_x=noise_x, noise_y=noise_y,
                          sensitivity=sensitivity, norm_factor=1.0 if self.accounting == "theorem2" else norm_factor)
        self.run_epsilon = None if self.accounting == "finite" else self.trajectory_epsilon(None)

    def trajectory_epsilon(self, rounds: int | None) -> float:
        """The accounting's epsilon of rounds 0..rounds-1 of one trajectory (``None``: the whole run)."""
        assert self.terms is not None
        return cpgt_epsilon_for(self.accounting, steps=rounds, **self.terms)  # type: ignore[arg-type]

    def _rounds_epsilon(self, rounds: int) -> float:
        """The coupling's terms of rounds 0..rounds-1 summed (Assumption 4 unless ``accounting="finite"``)."""
        assert self.terms is not None
        return cpgt_epsilon_after(rounds, **self.terms, linear_difference=self.accounting != "finite")

    def replay_epsilon(self) -> float:
        """What the rounds released twice add by composition: their terms, once more per replay."""
        return sum(self._rounds_epsilon(end) - self._rounds_epsilon(start) for start, end in self.replayed)

    release_type = LaplaceRelease

    def check_release(self, release: Any) -> LaplaceRelease:
        """A :class:`LaplaceRelease` at the scales and decay the bound's terms hold (:meth:`configure`)."""
        release = super().check_release(release)
        if self.terms is None:
            raise PrivacyConfigError("CPGT: a round was released before the ledger knew its noise (configure first)")
        priced = (self.terms["noise_x"], self.terms["noise_y"], self.terms["q"])
        if (release.noise_x, release.noise_y, release.noise_decay) != priced:
            raise PrivacyConfigError(
                f"CPGT: {release} differs from the noise the ledger accounts for (noise_x, noise_y, q) = {priced}"
            )
        return release

    def _record(self, release: LaplaceRelease, steps: int) -> None:
        self.rounds += steps

    @property
    def steps(self) -> int:
        """Rounds released in all: the current trajectory's and every replayed one."""
        return self.rounds + sum(end - start for start, end in self.replayed)

    def _epsilon_after(self, steps: int, release: LaplaceRelease | None) -> float:
        """0 before the first round; NaN (unknown, never 0) for rounds whose bound's terms are not known yet (a
        ledger restored from a checkpoint written before the noise was planned)."""
        if self.steps + steps == 0:
            return 0.0
        if self.terms is None:
            return math.nan
        trajectory = self.run_epsilon if self.run_epsilon is not None else self.trajectory_epsilon(self.rounds + steps)
        return trajectory + self.replay_epsilon()

    def charge_replay(self, state: Mapping[str, Any]) -> None:
        """Adopt a later state of this run (the write-ahead ledger's): the trajectory restarts at this ledger's round
        k0, and the rounds k0..k1-1 the crashed run had released are charged again as the resumed run re-sends them."""
        replayed = [(int(start), int(end)) for start, end in state["replayed"]]
        if int(state["steps"]) > self.rounds:
            replayed.append((self.rounds, int(state["steps"])))
        self.replayed = replayed

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.rounds, "replayed": [[start, end] for start, end in self.replayed],
                "terms": None if self.terms is None else dict(self.terms)}

    def saved_steps(self, state: Mapping[str, Any]) -> int:
        return int(state["steps"]) + sum(int(end) - int(start) for start, end in state["replayed"])

    def _load_state(self, state: Mapping[str, Any]) -> None:
        self.rounds = int(state["steps"])
        self.replayed = [(int(start), int(end)) for start, end in state["replayed"]]
        if state["terms"] is not None:  # the bound the saved rounds were released under (until the plan's own)
            self.configure(**{key: float(value) for key, value in state["terms"].items()})


# ---- CPGT's privacy configuration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CPGTOptions:
    """CPGT's own arguments, its budget included (pure epsilon-DP: no delta, no noise multiplier), validated once
    (by the strategy when it is built): the Laplace scales d_x, d_y (or
    ``None`` to calibrate d_x = d_y to the budget), the decay q (``"auto"``: chosen once alpha is known,
    :func:`~lightning_privdec.privacy.accounting.cpgt.auto_noise_decay`), the assumed smoothness L (required: the
    guarantee rests on it), the adjacency distance (or ``None``: 2 C / (q J) from clipping), its norm, the accounting
    and the budget."""

    noise_decay: float | str = "auto"
    lipschitz: float | None = None
    noise_x: float | None = None
    noise_y: float | None = None
    sensitivity: float | None = None
    sensitivity_norm: str = "l2"
    accounting: str = "sound"
    target_epsilon: float | None = None

    def __post_init__(self) -> None:
        if (self.noise_x is None) != (self.noise_y is None):
            raise PrivacyConfigError("give both noise_x and noise_y (the Laplace scales d_x, d_y), or neither")
        if self.noise_x is None and self.target_epsilon is None:
            raise PrivacyConfigError(
                "CPGT needs its Laplace noise scales: pass noise_x=... and noise_y=..., or target_epsilon=... to "
                "calibrate them (d_x = d_y)"
            )
        for name in ("noise_x", "noise_y", "target_epsilon", "sensitivity"):
            if getattr(self, name) is not None:
                check_positive(getattr(self, name), name, where="CPGT: ")
        if self.lipschitz is None:
            raise PrivacyConfigError(
                "CPGT's guarantee (Theorem 2) assumes every node's clipped loss gradient is L-smooth, ||grad f(x) - "
                "grad f(y)|| <= L ||x - y||, with an L that you state: the library cannot check it for your model, so "
                "it has no default. Pass lipschitz=L (e.g. CPGTStrategy(..., lipschitz=0.1)); Theorem 2 then needs "
                "the learning rate alpha < 1/(2L)"
            )
        check_positive(self.lipschitz, "lipschitz (L, the smoothness constant assumed for each node's gradient)",
                       where="CPGT: ")
        if self.noise_decay != "auto" and (
            isinstance(self.noise_decay, bool) or not isinstance(self.noise_decay, (int, float))
            or not 0 < self.noise_decay < 1
        ):
            raise PrivacyConfigError(f"CPGT: noise_decay (q) must be 'auto' or lie in (0, 1), got {self.noise_decay!r}")
        if self.accounting not in ACCOUNTING:
            raise PrivacyConfigError(f"CPGT: accounting must be one of {ACCOUNTING}, got {self.accounting!r}")
        if self.sensitivity_norm not in ("l2", "l1"):
            raise PrivacyConfigError(f"CPGT: sensitivity_norm must be 'l2' or 'l1', got {self.sensitivity_norm!r}")
        if self.sensitivity_norm == "l1" and self.sensitivity is None:
            raise PrivacyConfigError(
                "CPGT: sensitivity_norm='l1' needs an explicit l1 sensitivity=...: the distance derived from "
                "per-sample clipping, 2C/(qJ), is an l2 bound (keep sensitivity_norm='l2' to use it)"
            )
