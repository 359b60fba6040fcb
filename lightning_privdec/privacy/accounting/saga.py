"""Privacy accounting for PrivSGP-VR's released gradient (Zhu, Huang, Wang, Xu 2024), one node, one example.

Per step node i releases, in sum space (before the division by the public expected batch size qJ; Algorithm 1,
lines 6 and 8 in mini-batch form)::

    R = sum_{xi in S} (c_xi - t_xi)  +  q sum_j t_j  +  N(0, s^2 I)        (q sum_j t_j = qJ g_bar)

with S a Poisson sample of the shard at rate q, c_xi fresh per-sample gradients clipped to C and t the gradient
table, whose entries are clipped too (||t_j|| <= C). Under add/remove-one adjacency (Opacus's; q and the divisor qJ
are public) adding an example x* changes R by ``b (c_* - t_*) + q t_*`` with b ~ Bernoulli(q):

* the subsampled part moves by ||c_* - t_*|| <= 2C, and only when x* is sampled;
* the table mean moves by q ||t_*|| <= qC at EVERY step: x*'s row is in the table from the start (filled at z^0, or
  zero until x* is first sampled), so this part is not amplified by subsampling. After a full-pass initialisation
  the first step releases only this part (c = t at z^0): the clipped full gradient, with noise.

``accounting="sound"`` (default): split the noise, s^2 = s1^2 + s2^2, and release the two parts separately (R is
their sum: post-processing). Each step is then a Poisson-subsampled Gaussian with multiplier s1 / (2C) at rate q
composed with a Gaussian with multiplier s2 / (qC) at rate 1 — two ledger entries per step, composed by Opacus's RDP
or PRV accountant. The stored row t_* depends on when x* was last sampled, which nobody outside the node sees: given
the past outputs, a step's output law is a mixture over that hidden row, and the Renyi divergence (and every hockey-
stick divergence) is jointly (quasi-)convex, so the bound for the worst row (||t_*|| <= C) holds for the mixture and
adaptive composition applies. The split rho = s1^2 / s^2 is chosen to minimise epsilon (1-D search). A second valid
analysis of the same step treats it as one Gaussian at rate 1 with the joint sensitivity
max ||b (c_* - t_*) + q t_*|| = (2 - q) C; it is tighter when q is large (q >~ 0.3). The sound accounting uses
whichever of the two gives the smaller epsilon (``split=None`` marks the joint one), and s is calibrated to the target
over the planned steps.

``accounting="paper"``: the published Theorem 2 — sensitivity 3C amplified at rate q, one entry per step. Its
argument does not hold (the always-present table mean is amplified as if it were sampled); it is reported for
comparison only. Numerically it is never below the sound bound in the regimes checked (docs/privacy.md): with the
best split the sound bound matches it when q = 1 or the noise is large (3C = 2C + C in the central-limit regime) and
is smaller elsewhere.

``accounting="no_amplification"``: always the joint analysis (one Gaussian at rate 1, sensitivity (2 - q) C). Sound
and simple; far looser than the split for small q.

Here: one step's mechanisms (:class:`SagaNoise`), the epsilon of a noise level (:func:`saga_epsilon`), one node's
ledger (:class:`SagaAccountant`: a release is one step's mechanisms, :meth:`SagaNoise.entries`), and the paper's
Theorem 1 (eq. 10), Theorem 2 (eq. 11) and Corollary 1 (eq. 12) transcribed for K*. The inverse problem, the noise
for a target epsilon, is :mod:`.saga_calibration`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from opacus.accountants import RDPAccountant
from scipy.optimize import minimize_scalar

from lightning_privdec.privacy.accounting.gaussian import (
    GaussianRelease,
    SubsampledGaussianAccountant,
    _epsilon_of_history,
    cached_step_rdp,
)
from lightning_privdec.privacy.accounting.rdp import subsampled_gaussian_rdp
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.validation import (
    check_delta,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
)

__all__ = [
    "ACCOUNTINGS",
    "SagaAccountant",
    "SagaNoise",
    "SagaRelease",
    "c2_for_optimal_steps",
    "optimal_split",
    "optimal_steps",
    "paper_noise_std",
    "saga_epsilon",
    "saga_step_entries",
    "sound_split",
    "theorem1_bound",
]

#: the ``accounting=`` choices of PrivSGP-VR
ACCOUNTINGS: tuple[str, ...] = ("sound", "paper", "no_amplification")

#: accountants that can compose PrivSGP-VR's steps ("gdp" needs one constant (sigma, q))
SAGA_ACCOUNTANTS: tuple[str, ...] = ("rdp", "prv")

#: the RDP orders Opacus's RDPAccountant uses; the fast searches (here and in :mod:`.saga_calibration`) use the same
OPACUS_ORDERS = np.asarray(RDPAccountant.DEFAULT_ALPHAS, dtype=float)

History = Sequence[tuple[float, float, int]]


def check_accounting(accounting: str, accountant: str) -> None:
    """Raise a :class:`PrivacyConfigError` for an unknown ``accounting`` or an accountant that cannot compose it."""
    if accounting not in ACCOUNTINGS:
        raise PrivacyConfigError(
            f"unknown accounting {accounting!r} for PrivSGP-VR; choose 'sound' (default: the table mean is charged "
            "at every step), 'paper' (the published formula, not a proven guarantee) or 'no_amplification'"
        )
    if accountant not in SAGA_ACCOUNTANTS:
        raise PrivacyConfigError(
            f"accountant={accountant!r} cannot account for PrivSGP-VR: each step composes two different mechanisms "
            "(a subsampled and an always-present Gaussian), which the 'gdp' approximation does not handle. Use "
            "accountant='rdp' (default) or 'prv'."
        )


@dataclass(frozen=True)
class SagaNoise:
    """The noise of PrivSGP-VR's release and how it is accounted.

    Attributes:
        accounting: ``"sound"``, ``"paper"`` or ``"no_amplification"``.
        noise_multiplier: s / C, the standard deviation of the Gaussian added to the released SUM, in units of C.
        split: rho = s1^2 / s^2, the share of the noise variance charged to the subsampled part (``"sound"``); ``None``
            with ``"sound"``: the joint analysis (one Gaussian, sensitivity (2 - q) C) was the tighter one.
    """

    accounting: str
    noise_multiplier: float
    split: float | None = None

    def entries(self, sample_rate: float) -> list[tuple[float, float]]:
        """The (noise multiplier, sampling rate) mechanisms one step composes, as the ledger records them."""
        return saga_step_entries(self.noise_multiplier, sample_rate, self.accounting, self.split)


def saga_step_entries(
    noise_multiplier: float, sample_rate: float, accounting: str = "sound", split: float | None = None
) -> list[tuple[float, float]]:
    """One step's mechanisms for a release with noise std ``noise_multiplier * C`` (see the module docstring).

    ``"sound"``: ``[(s1 / 2C, q), (s2 / qC, 1)]`` with s1^2 = rho s^2, s2^2 = (1 - rho) s^2 (or, with
    ``split=None``, the joint ``[(s / (2 - q)C, 1)]``); ``"paper"``: ``[(s / 3C, q)]``; ``"no_amplification"``:
    ``[(s / (2 - q)C, 1)]``.
    """
    m = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    if accounting == "paper":
        return [(m / 3.0, q)]
    if accounting != "sound":
        check_accounting(accounting, "rdp")
    if accounting == "no_amplification" or split is None:
        return [(m / (2.0 - q), 1.0)]
    if not 0.0 < split < 1.0:
        raise PrivacyConfigError(f"the sound accounting's noise split rho must lie in (0, 1), got {split!r}")
    return [(m * math.sqrt(split) / 2.0, q), (m * math.sqrt(1.0 - split) / q, 1.0)]


# ---- RDP at Opacus's orders (the one-step RDP cached in .gaussian) ------------------------------------------------
def gaussian_rdp(q: float, sigma: float, steps: int) -> np.ndarray:
    """RDP at :data:`OPACUS_ORDERS` of ``steps`` Poisson-subsampled Gaussians (multiplier sigma, rate q): ``steps``
    times the cached one-step RDP (:func:`~.gaussian.cached_step_rdp`)."""
    if steps == 0:
        return np.zeros_like(OPACUS_ORDERS)
    return steps * cached_step_rdp(q, sigma)


def history_rdp(history: History) -> np.ndarray:
    """RDP at :data:`OPACUS_ORDERS` of a ledger history ``[(sigma, q, steps), ...]``."""
    total = np.zeros_like(OPACUS_ORDERS)
    for sigma, q, t in history:
        total = total + gaussian_rdp(float(q), float(sigma), int(t))
    return total


def rdp_conversion(delta: float) -> np.ndarray:
    """Opacus's RDP -> (epsilon, delta) term (Balle et al. 2020, Thm. 21): epsilon = min over orders of rdp + this."""
    return -(math.log(delta) + np.log(OPACUS_ORDERS)) / (OPACUS_ORDERS - 1.0) + np.log((OPACUS_ORDERS - 1.0) / OPACUS_ORDERS)


def history_with(
    history: History, noise: SagaNoise, sample_rate: float, steps: int
) -> list[tuple[float, float, int]]:
    """``history`` followed by ``steps`` steps of ``noise`` at ``sample_rate`` (their mechanisms as ledger entries)."""
    return [
        *((float(s), float(q), int(t)) for s, q, t in history),
        *((s, q, steps) for s, q in noise.entries(sample_rate)),
    ]


# ---- epsilon ------------------------------------------------------------------------------------------------------
def optimal_split(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, history: History = ()
) -> float:
    """The split rho = s1^2 / s^2 that minimises the sound epsilon of ``steps`` more steps (RDP; 1-D search).

    Any split gives a valid bound; this one gives the smallest (RDP) epsilon, and is used with the PRV accountant too.
    """
    m = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    steps = check_steps(steps, minimum=1)
    delta = check_delta(delta)
    if m == 0.0:
        return 0.5
    base = history_rdp(history)

    def eps(logit: float, orders: np.ndarray = OPACUS_ORDERS, base: np.ndarray = base) -> float:
        rho = 1.0 / (1.0 + math.exp(-logit))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rdp = base + steps * subsampled_gaussian_rdp(q, [m * math.sqrt(rho) / 2.0], orders)[0]
        rdp = rdp + steps * orders * q**2 / (2.0 * m**2 * (1.0 - rho))
        eps = rdp - (math.log(delta) + np.log(orders)) / (orders - 1.0) + np.log((orders - 1.0) / orders)
        return float(np.nanmin(eps))

    # coarse search on the integer orders (cheap), then a refinement on all of Opacus's orders around it
    integer = np.asarray([a for a in OPACUS_ORDERS if float(a).is_integer()])
    coarse_base = base[np.isin(OPACUS_ORDERS, integer)]
    coarse = minimize_scalar(lambda t: eps(t, integer, coarse_base), bounds=(-9.0, 9.0), method="bounded",
                             options={"xatol": 1e-2}).x
    logit = minimize_scalar(eps, bounds=(float(coarse) - 0.3, float(coarse) + 0.3), method="bounded",
                            options={"xatol": 1e-4}).x
    return 1.0 / (1.0 + math.exp(-float(logit)))


def sound_split(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    history: History = (),
    accountant: str = "rdp",
) -> float | None:
    """The sound accounting's choice for ``steps`` more steps: the optimal split rho, or ``None`` when the joint
    analysis (one Gaussian, sensitivity (2 - q) C, rate 1) gives the smaller epsilon (by ``accountant``)."""
    rho = optimal_split(noise_multiplier, sample_rate, steps, delta, history)
    split = saga_epsilon(noise_multiplier, sample_rate, steps, delta, accountant=accountant, split=rho, history=history)
    joint = saga_epsilon(
        noise_multiplier, sample_rate, steps, delta, accounting="no_amplification", accountant=accountant,
        history=history,
    )
    return rho if split <= joint else None


def saga_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    *,
    accounting: str = "sound",
    accountant: str = "rdp",
    split: float | str | None = "best",
    history: History = (),
) -> float:
    """Epsilon after ``steps`` PrivSGP-VR steps with noise std ``noise_multiplier * C`` on the released sum.

    ``split``: the sound accounting's noise split rho; ``"best"`` (default) takes :func:`sound_split`, ``None`` the
    joint analysis. ``history`` holds earlier ledger entries.
    """
    check_accounting(accounting, accountant)
    steps = check_steps(steps)
    delta = check_delta(delta)
    if accounting == "sound" and split == "best":
        split = sound_split(noise_multiplier, sample_rate, max(1, steps), delta, history, accountant)
    noise = SagaNoise(accounting, check_noise_multiplier(noise_multiplier), split)  # type: ignore[arg-type]
    with warnings.catch_warnings(), np.errstate(divide="ignore"):  # PRV at rate 1 takes log(1 - q) = -inf
        warnings.filterwarnings("ignore", message="Optimal order is the")
        return _epsilon_of_history(history_with(history, noise, sample_rate, steps), delta, accountant)


@dataclass(frozen=True)
class SagaRelease:
    """One PrivSGP-VR step: the Gaussian mechanisms it composes (:meth:`SagaNoise.entries`)."""

    mechanisms: tuple[GaussianRelease, ...]

    def __post_init__(self) -> None:
        mechanisms = tuple(self.mechanisms)
        if not mechanisms or not all(isinstance(m, GaussianRelease) for m in mechanisms):
            raise TypeError(f"a SagaRelease is one or more GaussianRelease(sigma, q), got {self.mechanisms!r}")
        object.__setattr__(self, "mechanisms", mechanisms)

    @classmethod
    def of(cls, entries: Sequence[tuple[float, float]]) -> SagaRelease:
        """From ``((sigma, q), ...)`` pairs (:meth:`SagaNoise.entries`)."""
        return cls(tuple(GaussianRelease(sigma, q) for sigma, q in entries))


class SagaAccountant(SubsampledGaussianAccountant):
    """One PrivSGP-VR node's accountant: a release is one step's mechanisms ``((sigma, q), ...)``
    (:meth:`SagaNoise.entries`), composed with everything recorded before by Opacus's RDP or PRV accountant.

    Each mechanism merges with any equal ``(sigma, q)`` entry of :attr:`history`, not only the last one: composition
    does not depend on the order, and the sound accounting records two alternating mechanisms per step, so the history
    stays at two entries. :attr:`steps` counts private steps (releases), not mechanisms.
    """

    def __init__(self, accountant: str = "rdp", delta: float | None = None) -> None:
        super().__init__(accountant, delta)
        self._steps = 0

    @staticmethod
    def _append(history: History, noise_multiplier: float, sample_rate: float, steps: int) -> list[tuple[float, float, int]]:
        history = list(history)
        for i, (sigma, q, count) in enumerate(history):
            if sigma == noise_multiplier and q == sample_rate:
                history[i] = (sigma, q, count + steps)
                return history
        history.append((noise_multiplier, sample_rate, steps))
        return history

    def _composed(self, mechanisms: Sequence[GaussianRelease], steps: int) -> list[tuple[float, float, int]]:
        history = self.history
        for mechanism in mechanisms:
            history = self._append(history, mechanism.noise_multiplier, mechanism.sample_rate, steps)
        return history

    def _epsilon(self, history: History, delta: float) -> float:
        with warnings.catch_warnings(), np.errstate(divide="ignore"):  # PRV at rate 1 takes log(1 - q) = -inf
            warnings.filterwarnings("ignore", message="Optimal order is the")
            return super()._epsilon(history, delta)

    release_type = SagaRelease  # type: ignore[assignment]

    def _record(self, release: SagaRelease, steps: int) -> None:  # type: ignore[override]
        """Account for ``steps`` steps that released every mechanism of ``release``."""
        self.history = self._composed(release.mechanisms, steps)
        self._steps += steps

    @property
    def steps(self) -> int:
        return self._steps

    def _epsilon_after(self, steps: int, release: SagaRelease | None) -> float:  # type: ignore[override]
        if release is None:
            return self.epsilon()
        return self._epsilon(self._composed(release.mechanisms, steps), self._delta(None))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps": self._steps}

    def saved_steps(self, state: Mapping[str, Any]) -> int:
        self._check_state(state)
        return int(state["steps"])

    def _load_state(self, state: Mapping[str, Any]) -> None:
        super()._load_state(state)
        self._steps = int(state["steps"])


# ---- the paper's formulas (Theorem 1 eq. 10, Theorem 2 eq. 11, Corollary 1 eq. 12) ---------------------------------
def _per_node(value: float | Sequence[float], n: int, name: str) -> list[float]:
    values = [float(value)] * n if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != n or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise PrivacyConfigError(f"{name} must be a positive number or {n} positive numbers (one per node)")
    return values


def _privacy_sum(epsilon: float | Sequence[float], delta: float | Sequence[float], n: int) -> float:
    """sum_i log(1 / delta_i) / epsilon_i^2 over the n nodes."""
    eps = _per_node(epsilon, n, "epsilon")
    deltas = _per_node(delta, n, "delta")
    if any(d >= 1 for d in deltas):
        raise PrivacyConfigError("every delta_i must lie in (0, 1)")
    return sum(math.log(1.0 / d) / e**2 for e, d in zip(eps, deltas))


def paper_noise_std(steps: int, J: int, G: float, epsilon: float, delta: float, c2: float) -> float:
    """Theorem 2, eq. (11): sigma_i = 3 c2 G sqrt(K log(1/delta_i)) / (J epsilon_i). ``c2`` is never given in the paper."""
    return 3.0 * c2 * G * math.sqrt(steps * math.log(1.0 / delta)) / (J * epsilon)


def _utility_constant(F0: float, L: float, x0_norm_sq: float, b_sq: float) -> float:
    """a = 13 F^0 + 6 L ||x^0||^2 + 18 L b^2 (Theorem 1)."""
    return 13.0 * F0 + 6.0 * L * x0_norm_sq + 18.0 * L * b_sq


def theorem1_bound(
    steps: float, *, n: int, d: int, L: float, F0: float, x0_norm_sq: float, b_sq: float, sigmas: Sequence[float]
) -> float:
    """Theorem 1, eq. (10): (1/K) sum_k (1/n) sum_i E||grad f(z_i^k)||^2 <= [a + 24 L (d/n) sum_i sigma_i^2] / sqrt(nK)."""
    sigma_sq = sum(s**2 for s in _per_node(list(sigmas), n, "sigmas"))
    return (_utility_constant(F0, L, x0_norm_sq, b_sq) + 24.0 * L * d / n * sigma_sq) / math.sqrt(n * steps)


def optimal_steps(
    *,
    J: int,
    n: int,
    d: int,
    L: float,
    G: float,
    F0: float,
    x0_norm_sq: float,
    b_sq: float,
    c2: float,
    epsilon: float | Sequence[float],
    delta: float | Sequence[float],
) -> float:
    """Corollary 1, eq. (12): K* = a J^2 n / (216 L d c2^2 G^2 sum_i log(1/delta_i) / epsilon_i^2).

    ``epsilon`` and ``delta`` are one value for every node or one per node. K* minimises Theorem 1's bound with
    sigma_i from eq. (11); there the mean sigma_i^2 equals a / (24 L d). ``c2`` (the moments accountant's constant) is
    never given in the paper, so K* is only as meaningful as the c2 one assumes (see :func:`c2_for_optimal_steps`).
    """
    a = _utility_constant(F0, L, x0_norm_sq, b_sq)
    return a * J**2 * n / (216.0 * L * d * c2**2 * G**2 * _privacy_sum(epsilon, delta, n))


def c2_for_optimal_steps(
    steps: float,
    *,
    J: int,
    n: int,
    d: int,
    L: float,
    G: float,
    F0: float,
    x0_norm_sq: float,
    b_sq: float,
    epsilon: float | Sequence[float],
    delta: float | Sequence[float],
) -> float:
    """The c2 for which eq. (12) gives ``steps`` (eq. 12 solved for c2): what a reported K* implies about c2."""
    k_at_one = optimal_steps(
        J=J, n=n, d=d, L=L, G=G, F0=F0, x0_norm_sq=x0_norm_sq, b_sq=b_sq, c2=1.0, epsilon=epsilon, delta=delta
    )
    return math.sqrt(k_at_one / steps)
