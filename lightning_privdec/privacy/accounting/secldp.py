"""The SecLDP accountant of Decor (Allouah, Koloskova, El Firdoussi, Jaggi, Guerraoui, ICML 2024): composition of
the per-round slope (:mod:`.secldp_step`) over rounds, the example level, the baselines and the calibration.

Composition and conversion: ``T`` rounds are ``(alpha, T alpha eps_step)``-SecRDP (Lemma 10), converted with
Lemma 11 at the optimal order (proof of Cor. 12). Example level: the whitened mechanism is a Gaussian with noise
multiplier ``1 / sqrt(2 eps_step)``; we amplify by Poisson subsampling, compose the subsampled RDP over ``T``
rounds, and only then convert to (epsilon, delta) (not the other way round, a known defect of the paper's code).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from scipy.optimize import brentq

from lightning_privdec.privacy.accounting.base import Accountant
from lightning_privdec.privacy.accounting.gaussian import cached_step_rdp
from lightning_privdec.privacy.accounting.rdp import subsampled_gaussian_rdp
from lightning_privdec.privacy.accounting.secldp_step import (
    Adversary,
    Level,
    Method,
    _adjacency,
    _delta,
    _number,
    _sample_rate,
    _step,
    _steps,
    collusion_level,
    secldp_sensitivity,
)
from lightning_privdec.privacy.errors import PrivacyConfigError


# ---- composition and conversion ---------------------------------------------------------------------------------
def secldp_epsilon(eps_step: float, steps: int, delta: float) -> float:
    """(epsilon, delta)-SecLDP after ``steps`` rounds of an ``(alpha, alpha eps_step)``-SecRDP mechanism.

    Composition (Decor Lemma 10) gives ``(alpha, T alpha eps_step)``; conversion (Lemma 11) gives
    ``T alpha eps_step + log(1/delta)/(alpha - 1)``, minimized at ``alpha* = 1 + sqrt(log(1/delta)/(T eps_step))``:
    ``epsilon = T eps_step + 2 sqrt(T eps_step log(1/delta))`` (proof of Decor Cor. 12).
    """
    eps_step = _number(eps_step, "eps_step", allow_inf=True)
    steps = _steps(steps)
    log_inv_delta = math.log(1.0 / _delta(delta))
    total = steps * eps_step if steps else 0.0
    if math.isinf(total):
        return math.inf
    return total + 2.0 * math.sqrt(total * log_inv_delta)


def eps_step_for(target_epsilon: float, steps: int, delta: float) -> float:
    """The per-round slope whose :func:`secldp_epsilon` is ``target_epsilon``:
    ``(sqrt(log(1/delta) + epsilon) - sqrt(log(1/delta)))^2 / T`` (inverse of the closed form)."""
    target_epsilon = _number(target_epsilon, "target_epsilon", strict=True)
    steps = _steps(steps, minimum=1)
    log_inv_delta = math.log(1.0 / _delta(delta))
    # sqrt(L + eps) - sqrt(L), written without cancellation
    root = target_epsilon / (math.sqrt(log_inv_delta + target_epsilon) + math.sqrt(log_inv_delta))
    return root * root / steps


def _orders(orders: Sequence[float] | None) -> list[float]:
    return list(RDPAccountant.DEFAULT_ALPHAS if orders is None else orders)


def secldp_epsilon_example_level(
    eps_step: float,
    steps: int,
    delta: float,
    sample_rate: float,
    *,
    orders: Sequence[float] | None = None,
) -> float:
    """Example-level (epsilon, delta) after ``steps`` rounds with Poisson sampling at rate ``sample_rate``.

    ``eps_step`` is the un-amplified slope at the example-level sensitivity (:func:`secldp_step` with
    ``level="example"``, i.e. ``Delta = C`` on the clipped sum). Whitening the honest releases by ``Sigma^{-1/2}``
    turns one round into a Gaussian mechanism whose sensitivity is ``Delta sqrt(max_i Sigma^{-1}_ii)``, i.e. noise
    multiplier ``z = 1/sqrt(2 eps_step)``; only the node holding the example is affected. We take the RDP of the
    Poisson subsampled Gaussian (Mironov, Talwar, Zhang 2019) at each order, multiply by ``T`` (compose), and then
    convert with Opacus's ``get_privacy_spent`` (Balle et al. 2020, Thm. 21) -- exactly Opacus's
    ``RDPAccountant`` for history ``[(z, sample_rate, steps)]``. Poisson sampling (not the paper's sampling without
    replacement, Wang et al. 2019) matches :func:`~lightning_privdec.privacy.poisson_dataloader`.
    """
    eps_step = _number(eps_step, "eps_step", allow_inf=True)
    steps = _steps(steps)
    delta = _delta(delta)
    sample_rate = _sample_rate(sample_rate)
    if steps == 0 or eps_step == 0.0:
        return 0.0
    if math.isinf(eps_step):
        return math.inf
    alphas = _orders(orders)
    noise_multiplier = 1.0 / math.sqrt(2.0 * eps_step)
    if orders is None:
        rdp = cached_step_rdp(sample_rate, noise_multiplier) * steps
    else:
        rdp = steps * subsampled_gaussian_rdp(sample_rate, [noise_multiplier], alphas)[0]
    epsilon, _ = rdp_analysis.get_privacy_spent(orders=alphas, rdp=rdp, delta=delta)
    return float(epsilon)


@functools.lru_cache(maxsize=256)
def _example_eps_step_for(
    target_epsilon: float, steps: int, delta: float, sample_rate: float, orders: tuple[float, ...] | None
) -> float:
    """The largest eps_step (relative precision 1e-10) whose example-level epsilon is <= target: a bracket by
    doubling, then Brent's method on log eps_step (epsilon grows continuously and monotonically with it), stepped
    down until the answer is within the target. Searched once per argument values (every node of a network
    calibrates the same budget)."""

    def epsilon(x: float) -> float:
        return secldp_epsilon_example_level(x, steps, delta, sample_rate, orders=orders)

    lo = hi = eps_step_for(target_epsilon, steps, delta)
    for _ in range(400):
        if epsilon(hi) > target_epsilon:
            break
        lo, hi = hi, hi * 2.0
    else:
        raise PrivacyConfigError(f"target_epsilon={target_epsilon:g} is reached without any noise")
    for _ in range(400):
        if epsilon(lo) <= target_epsilon:
            break
        lo, hi = lo / 2.0, lo
    else:
        raise PrivacyConfigError(f"target_epsilon={target_epsilon:g} cannot be reached at delta={delta:g}")
    if hi / lo <= 1.0 + 1e-10:
        return lo
    root = math.exp(brentq(lambda t: epsilon(math.exp(t)) - target_epsilon, math.log(lo), math.log(hi), xtol=1e-11))
    while root > lo and epsilon(root) > target_epsilon:
        root = max(lo, root * (1.0 - 1e-10))
    return root


# ---- baselines ----------------------------------------------------------------------------------------------------
def ldp_sigma(clip: float, eps_step: float, *, level: Level = "user") -> float:
    """LDP baseline noise (``sigma_cor = 0``): ``Delta / sqrt(2 eps_step)``, i.e. ``C sqrt(2) / sqrt(eps_step)`` at
    user level (Decor Sec. 6 and App. D.1)."""
    eps_step = _number(eps_step, "eps_step", strict=True)
    return secldp_sensitivity(clip, level) / math.sqrt(2.0 * eps_step)


# ---- calibration --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SecLDPCandidate:
    """One point of the sweep: ``sigma_cor`` is ``None`` when even ``sigma_cor_max`` does not meet the budget."""

    sigma_cdp: float
    sigma_cor: float | None
    epsilon_step: float | None
    epsilon: float | None

    @property
    def feasible(self) -> bool:
        return self.sigma_cor is not None


@dataclass(frozen=True)
class CalibrationResult:
    """A noise pair meeting the budget, and every pair of the sweep (Decor App. D.1).

    Rule: the *smallest feasible sigma_cdp* on the grid (it drives the dominant utility term, Decor Sec. 5),
    with its ``sigma_cor`` the smallest meeting the budget and at most ``sigma_cor_max``.
    """

    sigma_cdp: float
    sigma_cor: float
    epsilon_step: float
    epsilon: float
    target_epsilon: float
    target_epsilon_step: float
    delta: float
    steps: int
    adversary: Adversary
    level: Level
    sample_rate: float | None
    sigma_ldp: float
    sigma_cdp_floor: float
    sigma_cor_max: float
    alternatives: tuple[SecLDPCandidate, ...] = field(default_factory=tuple)


def calibrate_secldp(
    target_epsilon: float,
    delta: float,
    steps: int,
    graph: nx.Graph | Any,
    clip: float,
    adversary: Adversary = "eavesdropper",
    sample_rate: float | None = None,
    *,
    num_candidates: int = 12,
    sigma_cor_max: float | None = None,
    method: Method = "auto",
    orders: Sequence[float] | None = None,
) -> CalibrationResult:
    """Find ``(sigma_cdp, sigma_cor)`` meeting ``target_epsilon`` after ``steps`` rounds (Decor App. D.1).

    1. Per-round budget: ``eps_step`` from :func:`eps_step_for` (user level), or, with ``sample_rate``, the largest
       ``eps_step`` whose :func:`secldp_epsilon_example_level` meets the target (bisection; example level).
    2. ``sigma_cdp`` on a geometric grid of ``num_candidates`` points from the CDP level ``sigma_LDP / sqrt(n)`` to
       the LDP level ``sigma_LDP = Delta / sqrt(2 eps_step)``.
    3. For each, the smallest ``sigma_cor`` in ``[0, sigma_cor_max]`` with :func:`secldp_step` ``<= eps_step``
       (root finding; the accountant is non-increasing in ``sigma_cor``); infeasible if even ``sigma_cor_max`` fails.
       Near the CDP level this always happens: the exact slope tends to the CDP value only as ``sigma_cor -> inf``.

    ``sigma_cor_max`` defaults to ``10 sigma_LDP``. The chosen pair is the feasible one with the smallest
    ``sigma_cdp``; ``alternatives`` lists every grid point. Every feasible pair's epsilon is ``<= target`` (up to
    rounding) and within about 1e-9 of it. Raises :class:`PrivacyConfigError` on invalid input.
    """
    target_epsilon = _number(target_epsilon, "target_epsilon", strict=True)
    delta = _delta(delta)
    steps = _steps(steps, minimum=1)
    adj = _adjacency(graph)
    n = adj.shape[0]
    q = collusion_level(adversary, n)
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 2:
        raise PrivacyConfigError(f"num_candidates must be an integer >= 2, got {num_candidates!r}")
    level: Level = "user" if sample_rate is None else "example"
    if sample_rate is None:
        target_step = eps_step_for(target_epsilon, steps, delta)

        def epsilon_of(step: float) -> float:
            return secldp_epsilon(step, steps, delta)
    else:
        sample_rate = _sample_rate(sample_rate)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Optimal order is the")
            target_step = _example_eps_step_for(
                target_epsilon, steps, delta, sample_rate, None if orders is None else tuple(orders)
            )

        def epsilon_of(step: float) -> float:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Optimal order is the")
                return secldp_epsilon_example_level(step, steps, delta, sample_rate, orders=orders)

    sigma_ldp = ldp_sigma(clip, target_step, level=level)
    floor = sigma_ldp / math.sqrt(n)
    cap = 10.0 * sigma_ldp if sigma_cor_max is None else _number(sigma_cor_max, "sigma_cor_max", strict=True)

    sensitivity = secldp_sensitivity(clip, level)

    def step(sigma_cdp: float, sigma_cor: float) -> float:
        return _step(adj, sigma_cdp, sigma_cor, sensitivity, q, method)

    candidates: list[SecLDPCandidate] = []
    for k, sigma_cdp in enumerate(np.geomspace(floor, sigma_ldp, num_candidates)):
        sigma_cdp = sigma_ldp if k == num_candidates - 1 else float(sigma_cdp)
        if step(sigma_cdp, 0.0) <= target_step * (1.0 + 1e-12):
            sigma_cor = 0.0
        elif step(sigma_cdp, cap) > target_step:
            candidates.append(SecLDPCandidate(sigma_cdp, None, None, None))
            continue
        else:
            sigma_cor = brentq(
                lambda s, c=sigma_cdp: step(c, s) / target_step - 1.0, 0.0, cap, xtol=1e-12 * cap, rtol=1e-10
            )
            for _ in range(60):  # land on the private side of the root
                if step(sigma_cdp, sigma_cor) <= target_step:
                    break
                sigma_cor = min(cap, sigma_cor * (1.0 + 1e-9) + 1e-15 * cap)
        achieved_step = step(sigma_cdp, sigma_cor)
        candidates.append(SecLDPCandidate(sigma_cdp, float(sigma_cor), achieved_step, epsilon_of(achieved_step)))
    feasible = [c for c in candidates if c.feasible]
    if not feasible:  # cannot happen: sigma_LDP with sigma_cor = 0 always meets the budget
        raise PrivacyConfigError("no feasible (sigma_cdp, sigma_cor) pair found")
    best = min(feasible, key=lambda c: c.sigma_cdp)
    assert best.sigma_cor is not None and best.epsilon_step is not None and best.epsilon is not None
    return CalibrationResult(
        sigma_cdp=best.sigma_cdp,
        sigma_cor=best.sigma_cor,
        epsilon_step=best.epsilon_step,
        epsilon=best.epsilon,
        target_epsilon=target_epsilon,
        target_epsilon_step=target_step,
        delta=delta,
        steps=steps,
        adversary=adversary,
        level=level,
        sample_rate=sample_rate,
        sigma_ldp=sigma_ldp,
        sigma_cdp_floor=floor,
        sigma_cor_max=cap,
        alternatives=tuple(candidates),
    )


# ---- the ledger -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SecLDPRelease:
    """One Decor round: its SecRDP slope eps_step (:func:`~.secldp_step.secldp_step`; inf: no privacy) and, at the
    example level, the Poisson rate q (``None`` at the user level)."""

    epsilon_step: float
    sample_rate: float | None = None

    def __post_init__(self) -> None:
        e = self.epsilon_step
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not float(e) >= 0:
            raise PrivacyConfigError(f"epsilon_step (a round's SecRDP slope) must be a number >= 0, got {e!r}")
        q = self.sample_rate
        if q is not None and (isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < float(q) <= 1.0):
            raise PrivacyConfigError(f"sample_rate must be None (user level) or lie in (0, 1], got {q!r}")
        object.__setattr__(self, "epsilon_step", float(e))
        object.__setattr__(self, "sample_rate", None if q is None else float(q))


class SecLDPAccountant(Accountant):
    """One Decor node's SecLDP ledger: the rounds it released, each ``(alpha, alpha eps_step)``-SecRDP.

    A release is a :class:`SecLDPRelease`: the round's slope and, at the example level, the Poisson rate. User level: epsilon of the summed slopes (Lemmas 10-11, as
    :func:`secldp_epsilon`); example level: the subsampled Gaussian RDP of every round composed, then converted (as
    :func:`secldp_epsilon_example_level`).
    """

    def __init__(self, delta: float, level: Level) -> None:
        self.delta, self.level = _delta(delta), level
        self.history: list[tuple[float, float | None, int]] = []

    release_type = SecLDPRelease

    def _record(self, release: SecLDPRelease, steps: int) -> None:
        self.history = self._extended(self.history, release.epsilon_step, release.sample_rate, steps)

    @staticmethod
    def _extended(
        history: list[tuple[float, float | None, int]], epsilon_step: float, sample_rate: float | None, rounds: int
    ) -> list[tuple[float, float | None, int]]:
        history = list(history)
        if history and history[-1][:2] == (epsilon_step, sample_rate):
            history[-1] = (epsilon_step, sample_rate, history[-1][2] + rounds)
        elif rounds:
            history.append((epsilon_step, sample_rate, rounds))
        return history

    @property
    def steps(self) -> int:
        return sum(t for _, _, t in self.history)

    def _epsilon_after(self, steps: int, release: SecLDPRelease | None) -> float:
        history = self.history if release is None else self._extended(
            self.history, release.epsilon_step, release.sample_rate, steps
        )
        if not history:
            return 0.0
        if self.level == "user":
            if len(history) == 1:
                return secldp_epsilon(history[0][0], history[0][2], self.delta)
            return secldp_epsilon(sum(e * t for e, _, t in history), 1, self.delta)
        if len(history) == 1:
            (epsilon_step, q, rounds), = history
            return secldp_epsilon_example_level(epsilon_step, rounds, self.delta, q)  # type: ignore[arg-type]
        if any(math.isinf(e) for e, _, _ in history):
            return math.inf
        alphas = _orders(None)
        rdp = sum(cached_step_rdp(q, 1.0 / math.sqrt(2.0 * e)) * t for e, q, t in history if e > 0)
        epsilon, _ = rdp_analysis.get_privacy_spent(orders=alphas, rdp=rdp, delta=self.delta)
        return float(epsilon)

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "delta": self.delta, "history": [list(entry) for entry in self.history]}

    def saved_steps(self, state: Mapping[str, Any]) -> int:
        return sum(int(t) for _, _, t in state["history"])

    def _load_state(self, state: Mapping[str, Any]) -> None:
        self.history = [(float(e), None if q is None else float(q), int(t)) for e, q, t in state["history"]]
