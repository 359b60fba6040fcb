"""The noise PrivSGP-VR needs for a target epsilon: the inverse of :func:`~.saga.saga_epsilon`.

``accounting="sound"`` with RDP is solved exactly: for each subsampled multiplier sigma_1 the always-present part's
smallest multiplier follows in closed form order by order, and s(sigma_1) is minimised by a 1-D search; the joint
analysis is calibrated too and the smaller noise wins. With PRV, and for ``"paper"`` / ``"no_amplification"`` on top
of a history, s is found by bisection on the accountant's epsilon.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np

from lightning_privdec.privacy.accounting.base import golden_section_min
from lightning_privdec.privacy.accounting.gaussian import (
    _epsilon_of_history,
    calibrate_noise_multiplier,
)
from lightning_privdec.privacy.accounting.saga import (
    OPACUS_ORDERS,
    History,
    SagaNoise,
    check_accounting,
    gaussian_rdp,
    history_rdp,
    history_with,
    rdp_conversion,
)
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.validation import (
    check_delta,
    check_positive,
    check_sample_rate,
    check_steps,
)

__all__ = ["calibrate_saga_noise"]


def _sound_rdp_calibration(target: float, delta: float, q: float, steps: int, history: History) -> SagaNoise:
    """Smallest s (RDP) with epsilon <= target: for each subsampled multiplier sigma_1, the always-present part's
    smallest multiplier follows in closed form order by order; then s(sigma_1) is minimised by a 1-D search."""
    base = history_rdp(history) + rdp_conversion(delta)
    steps_orders = steps * OPACUS_ORDERS

    def noise_for(log_sigma1: float) -> tuple[float, float, float]:
        sigma1 = math.exp(log_sigma1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            slack = target - (base + gaussian_rdp(q, sigma1, steps))
        feasible = slack > 0
        if not feasible.any():
            return math.inf, sigma1, math.inf
        sigma2_sq = float(np.min(steps_orders[feasible] / (2.0 * slack[feasible])))  # sum_k alpha/(2 sigma2^2) <= slack
        return math.sqrt(4.0 * sigma1**2 + q**2 * sigma2_sq), sigma1, math.sqrt(sigma2_sq)

    # bracket the minimum on a geometric grid (infeasible, then decreasing, then increasing), then golden section
    grid: list[float] = []
    values: list[float] = []
    for k in range(64):
        grid.append(math.log(0.01) + k * math.log(2.0))
        values.append(noise_for(grid[-1])[0])
        if len(values) >= 2 and math.isfinite(values[-2]) and values[-1] > values[-2]:
            break
    if not math.isfinite(min(values)):
        raise PrivacyConfigError(
            f"cannot reach target_epsilon={target:g} at delta={delta:g} with PrivSGP-VR over {steps} steps at sample "
            f"rate {q:g}: the history already spends it, or the target is below the accountant's floor; raise "
            "target_epsilon or plan fewer steps"
        )
    best = int(np.argmin(values))
    lo, hi = grid[max(0, best - 1)], grid[min(len(grid) - 1, best + 1)]
    log_sigma1 = golden_section_min(lambda g: noise_for(g)[0], lo, hi, tol=1e-5)
    m, sigma1, _ = noise_for(log_sigma1)
    if not math.isfinite(m):
        raise PrivacyConfigError(f"PrivSGP-VR calibration failed for target_epsilon={target:g} (no feasible noise)")
    return SagaNoise("sound", m, 4.0 * sigma1**2 / m**2)


def _bisect_noise(
    epsilon_of: Callable[[float], float], target: float, start: float, tolerance: float, where: str
) -> float:
    """Smallest multiplier m (within ``tolerance`` relative epsilon) with epsilon_of(m) <= target; epsilon_of decreases."""
    lo, hi = start, start
    while epsilon_of(hi) > target:
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            raise PrivacyConfigError(f"cannot reach {where}: even a noise multiplier of 1e6 exceeds the target")
    while epsilon_of(lo) <= target:
        hi, lo = lo, lo / 2.0
        if lo < 1e-3:
            raise PrivacyConfigError(
                f"cannot calibrate {where}: a noise multiplier below 1e-3 would do, i.e. essentially no noise; lower "
                "target_epsilon or pass noise_multiplier directly"
            )
    for _ in range(100):
        if epsilon_of(hi) >= (1.0 - tolerance) * target:
            break
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if epsilon_of(mid) > target else (lo, mid)
    return hi


def calibrate_saga_noise(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    *,
    accounting: str = "sound",
    accountant: str = "rdp",
    history: History = (),
    epsilon_tolerance: float = 0.01,
) -> SagaNoise:
    """The smallest noise (and, for ``"sound"``, the split) that spends at most ``target_epsilon`` over the history
    plus ``steps`` more steps, within ``epsilon_tolerance`` (relative): ``(1 - tol) target <= epsilon <= target``.

    Sound + RDP is solved exactly (closed form per order, 1-D search over the subsampled share); with PRV the split is
    the RDP-optimal one and s is found by bisection with PRV.
    """
    with warnings.catch_warnings(), np.errstate(divide="ignore"):  # Opacus's order-range note; PRV's log(1 - 1)
        warnings.filterwarnings("ignore", message="Optimal order is the")
        return _calibrate(
            target_epsilon, target_delta, sample_rate, steps, accounting, accountant, history, epsilon_tolerance
        )


def _calibrate(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accounting: str,
    accountant: str,
    history: History,
    epsilon_tolerance: float,
) -> SagaNoise:
    check_accounting(accounting, accountant)
    target = check_positive(target_epsilon, "target_epsilon")
    delta = check_delta(target_delta, "target_delta")
    q = check_sample_rate(sample_rate)
    steps = check_steps(steps, minimum=1)
    where = f"target_epsilon={target:g}, target_delta={delta:g}, sample_rate={q:g}, steps={steps}"

    def epsilon(noise: SagaNoise) -> float:
        return _epsilon_of_history(history_with(history, noise, q, steps), delta, accountant)

    if accounting == "sound":  # the better of the split (calibrated here) and the joint analysis (below)
        noise = _sound_rdp_calibration(target, delta, q, steps, history)
        if accountant == "rdp":
            for _ in range(20):  # the closed form is exact; guard against the last floating-point ulp
                if epsilon(noise) <= target:
                    break
                noise = SagaNoise("sound", noise.noise_multiplier * (1.0 + 1e-9), noise.split)
            else:
                raise PrivacyConfigError(f"PrivSGP-VR calibration for {where} overshot the target")
        else:
            split = noise.split
            noise = SagaNoise("sound", _bisect_noise(
                lambda m: epsilon(SagaNoise("sound", m, split)), target, noise.noise_multiplier, epsilon_tolerance, where
            ), split)
        joint = calibrate_saga_noise(
            target, delta, q, steps, accounting="no_amplification", accountant=accountant, history=history,
            epsilon_tolerance=epsilon_tolerance,
        )
        if joint.noise_multiplier < noise.noise_multiplier:
            return SagaNoise("sound", joint.noise_multiplier, None)
        return noise
    factor = 3.0 if accounting == "paper" else 2.0 - q
    if not history:
        rate = q if accounting == "paper" else 1.0
        sigma = calibrate_noise_multiplier(target, delta, rate, steps, accountant, epsilon_tolerance)
        return SagaNoise(accounting, sigma * factor)
    start = calibrate_noise_multiplier(target, delta, q if accounting == "paper" else 1.0, steps, accountant) * factor
    m = _bisect_noise(lambda m: epsilon(SagaNoise(accounting, m)), target, start, epsilon_tolerance, where)
    return SagaNoise(accounting, m)
