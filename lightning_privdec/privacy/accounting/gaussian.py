"""Privacy accounting for one node's Poisson-subsampled Gaussian mechanism (DP-SGD), via Opacus's accountants.

Each node runs DP-SGD on its own shard: every step releases ``sum_i clip(g_i) + N(0, sigma^2 C^2 I)`` over a
Poisson sample of rate ``q`` (Abadi et al. 2016, Algorithm 1). Its (epsilon, delta) after a history of
``(sigma, q, steps)`` entries is computed by one of Opacus's accountants:

* ``"rdp"``: Renyi DP of the subsampled Gaussian (Mironov 2017; Mironov, Talwar, Zhang 2019, Sec. 3), converted
  to (epsilon, delta) with Balle et al. 2020, Thm. 21. Sound, slightly loose; the default.
* ``"prv"``: numerical composition of privacy-loss random variables (Gopi et al. 2021). Tight upper bound; slower.

mu-GDP with the central limit theorem (Dong, Roth, Su 2019, Cor. 5.4) is NOT an accountant here: it is an
approximation that can print an epsilon far below the true one (q = 0.001, sigma = 0.5, T = 10: 0.069 against a
tight 1.086), so it never calibrates noise, enforces a budget or fills a field named "epsilon".
:func:`~.composition.gdp_epsilon_approximation` computes it for display, labelled as an approximation, next to a
sound value.

In decentralized learning each node's guarantee is per node, for sample-level adjacency on that node's shard:
``q = B / J`` with ``J`` the shard size, never the global dataset size.
"""

from __future__ import annotations

import contextvars
import functools
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from opacus.accountants import (
    IAccountant,
    PRVAccountant,
    RDPAccountant,
    create_accountant,
    register_accountant,
)
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.analysis.prv import Domain, PoissonSubsampledGaussianPRV
from opacus.accountants.utils import MAX_SIGMA, get_noise_multiplier

from lightning_privdec.privacy.accounting.base import Accountant
from lightning_privdec.privacy.accounting.rdp import subsampled_gaussian_rdp
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.validation import (
    check_delta,
    check_noise_multiplier,
    check_number,
    check_positive,
    check_sample_rate,
    check_steps,
)

__all__ = [
    "ACCOUNTANTS",
    "GDP_REFUSAL",
    "GaussianRelease",
    "SubsampledGaussianAccountant",
    "calibrate_noise_multiplier",
    "check_accountant",
    "epsilon_for",
    "make_accountant",
]

#: accountant names accepted everywhere (``accountant=`` keyword, CLI ``--accountant``)
ACCOUNTANTS: tuple[str, ...] = ("rdp", "prv")  # the sound ones: they calibrate, enforce and report

#: why "gdp" is refused wherever an epsilon decides something (strategies, calibration, ledgers)
GDP_REFUSAL = (
    "accountant='gdp' is refused: the Gaussian-DP accountant is a central-limit approximation (Dong, Roth, Su 2019) "
    "that can under-estimate epsilon by more than 10x for few steps or small sampling rates (q=0.001, sigma=0.5, "
    "10 steps: 0.069 against a tight 1.086) and, used to calibrate noise, overshoots the target by up to 3.7x. "
    "Use accountant='rdp' (default, sound) or 'prv' (sound and tight); `privdec-account dpsgd --accountant gdp` "
    "shows the GDP approximation next to the sound value"
)

#: the PRV accountant discretises the privacy loss on a grid; beyond this many points it needs gigabytes of memory
#: (tiny noise multipliers or huge step counts). We refuse instead of exhausting the machine.
PRV_MAX_DOMAIN_SIZE = 20_000_000

#: calibration never searches below this noise multiplier (a target that needs less noise is no meaningful privacy)
MIN_CALIBRATED_NOISE_MULTIPLIER = 1e-3

#: calibration gives up after this many epsilon evaluations instead of looping forever
MAX_CALIBRATION_EVALUATIONS = 200

History = list[tuple[float, float, int]]


# ---- validation helpers -----------------------------------------------------------------------------------------
def check_accountant(name: str) -> str:
    """``name`` if it is a sound accountant ("rdp", "prv"); otherwise a :class:`PrivacyConfigError` saying why."""
    if name == "gdp":
        raise PrivacyConfigError(GDP_REFUSAL)
    if not isinstance(name, str) or name not in ACCOUNTANTS:
        raise PrivacyConfigError(
            f"unknown accountant {name!r}; choose one of {', '.join(repr(a) for a in ACCOUNTANTS)} "
            "('rdp' is the sound default, 'prv' the tightest)"
        )
    return name



@dataclass(frozen=True)
class GaussianRelease:
    """One Poisson-subsampled Gaussian step: noise multiplier sigma (std in units of the clip bound) at rate q."""

    noise_multiplier: float
    sample_rate: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", check_noise_multiplier(self.noise_multiplier))
        object.__setattr__(self, "sample_rate", check_sample_rate(self.sample_rate))


# ---- epsilon of a history ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def cached_step_rdp(sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian step (:func:`~.rdp.subsampled_gaussian_rdp`) at the orders of Opacus's
    ``RDPAccountant`` (``DEFAULT_ALPHAS``); ``steps`` steps compose to ``steps`` times it.

    Computed once per (q, sigma) and returned read-only: a budget check asks the same (q, sigma) at many step counts,
    and the fractional orders are a series per order (pure Python) each time.
    """
    rdp = subsampled_gaussian_rdp(sample_rate, [noise_multiplier], RDPAccountant.DEFAULT_ALPHAS)[0]
    rdp.setflags(write=False)
    return rdp


def _rdp_epsilon(history: History, delta: float) -> float:
    """Opacus's ``RDPAccountant.get_epsilon`` on ``history``, the same arithmetic with the per-step RDP cached."""
    rdp = sum(cached_step_rdp(q, sigma) * t for sigma, q, t in history)
    epsilon, _ = rdp_analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(epsilon)


class CachedPRVAccountant(PRVAccountant):
    """Opacus's ``PRVAccountant`` (Gopi et al. 2021), the same numbers, with the discretisation domain's RDP bounds
    (Opacus's ``compute_safe_domain_size``, the paper's Remark 5.6) from the cached per-step RDP: every epsilon
    evaluates them, and a budget check asks the same (q, sigma) at many step counts."""

    def _get_domain(
        self, prvs: list[PoissonSubsampledGaussianPRV], num_self_compositions: list[int], eps_error: float,
        delta_error: float,
    ) -> Domain:
        total = sum(num_self_compositions)
        history = [(prv.noise_multiplier, prv.sample_rate, t) for prv, t in zip(prvs, num_self_compositions)]
        bound = _rdp_epsilon(history, delta_error / 4)
        for sigma, q, _ in history:
            bound = max(bound, _rdp_epsilon([(sigma, q, 1)], delta_error / (8 * total)))
        half_width = max(bound, eps_error) + 3
        mesh_size = eps_error / np.sqrt(total * np.log(12 / delta_error) / 2)
        return Domain.create_aligned(-half_width, half_width, mesh_size)


def make_accountant(name: str = "rdp") -> IAccountant:
    """A fresh Opacus accountant for ``"rdp"`` (``opacus.accountants.create_accountant``) or ``"prv"``
    (:class:`CachedPRVAccountant`)."""
    return CachedPRVAccountant() if check_accountant(name) == "prv" else create_accountant(name)


def _prv_domain_size(history: History, eps_error: float, delta_error: float) -> int:
    """Grid size the PRV accountant would allocate for ``history`` (Gopi et al. 2021, Sec. 5.1), without allocating."""
    prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
    domain = CachedPRVAccountant()._get_domain(
        prvs=prvs, num_self_compositions=[t for _, _, t in history], eps_error=eps_error, delta_error=delta_error
    )
    return int(domain.size)


def _epsilon_of_history(history: History, delta: float, accountant: str) -> float:
    """Epsilon of a composed history of Poisson-subsampled Gaussian steps, by the named Opacus accountant."""
    return _composed_epsilon(tuple((float(s), float(q), int(t)) for s, q, t in history if int(t) > 0),
                             float(delta), accountant)


@functools.lru_cache(maxsize=4096)
def _composed_epsilon(history: tuple[tuple[float, float, int], ...], delta: float, accountant: str) -> float:
    """:func:`_epsilon_of_history` of a normalised history, computed once per argument values: a pure function that
    calibrations, budget checks and every node of an in-process network evaluate again at the same points."""
    history = list(history)
    if not history:
        return 0.0
    if any(sigma == 0.0 for sigma, _, _ in history):
        return math.inf  # no noise: no privacy
    if accountant == "prv":
        eps_error, delta_error = 0.01, delta / 1000  # Opacus's PRVAccountant defaults
        size = _prv_domain_size(history, eps_error, delta_error)
        if size > PRV_MAX_DOMAIN_SIZE:
            raise PrivacyConfigError(
                f"the 'prv' accountant would need a {size:,}-point grid for this history (noise multiplier "
                f"{min(s for s, _, _ in history):.3g}, {sum(t for _, _, t in history):,} steps), far beyond "
                f"{PRV_MAX_DOMAIN_SIZE:,}; this means almost no noise (epsilon is huge). Use accountant='rdp', or a "
                "larger noise_multiplier / smaller target_epsilon."
            )
    if accountant == "rdp":
        return _rdp_epsilon(history, delta)
    opacus_accountant = make_accountant(accountant)
    opacus_accountant.history = list(history)
    return float(opacus_accountant.get_epsilon(delta=delta))


def epsilon_for(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """Epsilon of ``steps`` DP-SGD steps with noise multiplier sigma and Poisson rate q at the given delta.

    The mechanism is the Poisson-subsampled Gaussian (Abadi et al. 2016, Algorithm 1); ``accountant`` picks the
    analysis (see the module docstring). ``noise_multiplier = 0`` returns ``inf``.
    """
    accountant = check_accountant(accountant)
    history = [
        (check_noise_multiplier(noise_multiplier), check_sample_rate(sample_rate), check_steps(steps))
    ]
    return _epsilon_of_history(history, check_delta(delta), accountant)


# ---- calibration ------------------------------------------------------------------------------------------------
class _CalibrationStop(Exception):
    """Raised inside Opacus's search to stop it with a message (converted to PrivacyConfigError)."""


class _Guard:
    def __init__(self, accountant: str) -> None:
        self.accountant = accountant
        self.evaluations = 0

    def check(self, history: History) -> None:
        self.evaluations += 1
        if self.evaluations > MAX_CALIBRATION_EVALUATIONS:
            raise _CalibrationStop(
                f"the search did not converge within {MAX_CALIBRATION_EVALUATIONS} epsilon evaluations"
            )
        sigma = min(s for s, _, _ in history)
        if sigma < MIN_CALIBRATED_NOISE_MULTIPLIER:
            raise _CalibrationStop(
                f"reaching it would need a noise multiplier below {MIN_CALIBRATED_NOISE_MULTIPLIER:g}, i.e. "
                "essentially no noise"
            )


_OPACUS_CLASSES: dict[str, type[IAccountant]] = {"rdp": RDPAccountant, "prv": CachedPRVAccountant}
_GUARDED: set[str] = set()
_ACTIVE_GUARD: contextvars.ContextVar[_Guard | None] = contextvars.ContextVar("privdec_calibration", default=None)


def _guarded_mechanism(accountant: str) -> str:
    """Register (once) an Opacus accountant that routes ``get_noise_multiplier``'s search through our guard.

    Opacus's bisection has no iteration limit and evaluates whatever sigma it reaches; the guard bounds the number
    of evaluations and the smallest sigma, and uses :func:`_epsilon_of_history` (with its PRV edge cases).
    """
    mechanism = f"_lightning_privdec_guarded_{accountant}"
    if mechanism not in _GUARDED:
        base = _OPACUS_CLASSES[accountant]

        def get_epsilon(self: IAccountant, delta: float, *args: Any, **kwargs: Any) -> float:
            guard = _ACTIVE_GUARD.get()
            if guard is not None:
                guard.check(self.history)
            return _epsilon_of_history(self.history, delta, accountant)

        def __init__(self: IAccountant) -> None:  # noqa: N807
            self.history = []

        guarded = type(f"_Guarded{base.__name__}", (base,), {"get_epsilon": get_epsilon, "__init__": __init__})
        register_accountant(mechanism, guarded, force=True)
        _GUARDED.add(mechanism)
    return mechanism


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    epsilon_tolerance: float = 0.01,
) -> float:
    """The smallest noise multiplier (up to the tolerance) with epsilon <= target after ``steps`` DP-SGD steps.

    Uses Opacus's bisection ``opacus.accountants.utils.get_noise_multiplier`` with the named accountant. The
    tolerance is *relative*: the returned sigma satisfies
    ``(1 - epsilon_tolerance) * target_epsilon <= epsilon_for(sigma, ...) <= target_epsilon`` (checked).

    Raises:
        PrivacyConfigError: invalid arguments, or a target that cannot be reached (so small that even a noise
            multiplier of ~1e6 exceeds it, or so large that essentially no noise is needed).
    """
    accountant = check_accountant(accountant)
    target_epsilon = check_positive(target_epsilon, "target_epsilon")
    target_delta = check_delta(target_delta, "target_delta")
    sample_rate = check_sample_rate(sample_rate)
    steps = check_steps(steps, minimum=1)
    epsilon_tolerance = check_number(epsilon_tolerance, "epsilon_tolerance")
    if not 0.0 < epsilon_tolerance < 1.0:
        raise PrivacyConfigError(
            f"epsilon_tolerance is relative and must lie in (0, 1), got {epsilon_tolerance!r} (0.01 = 1%)"
        )
    return _calibrated_noise_multiplier(target_epsilon, target_delta, sample_rate, steps, accountant, epsilon_tolerance)


@functools.lru_cache(maxsize=256)
def _calibrated_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
    epsilon_tolerance: float,
) -> float:
    """:func:`calibrate_noise_multiplier` of checked arguments, searched once per argument values (every node of a
    network, and every strategy built for the same budget, asks the same question; a refusal is not cached)."""
    where = (
        f"target_epsilon={target_epsilon:g}, target_delta={target_delta:g}, sample_rate={sample_rate:g}, "
        f"steps={steps}, accountant={accountant!r}"
    )
    # Cheap reachability check first: the most noise Opacus would try. (At huge sigma the RDP optimum sits at the
    # largest order and Opacus warns about it; that is expected here.)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the")
        floor = _epsilon_of_history([(MAX_SIGMA, sample_rate, steps)], target_delta, accountant)
    if floor > target_epsilon:
        raise PrivacyConfigError(
            f"cannot reach {where}: even a noise multiplier of {MAX_SIGMA:g} gives epsilon = {floor:.4g} (the "
            f"{accountant!r} accountant's floor at this delta). Raise target_epsilon or target_delta, or use fewer "
            "steps / a smaller sample_rate."
        )

    guard = _Guard(accountant)
    token = _ACTIVE_GUARD.set(guard)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Optimal order is the")
            sigma = get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=target_delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=_guarded_mechanism(accountant),
                epsilon_tolerance=epsilon_tolerance * target_epsilon,
            )
    except _CalibrationStop as stop:
        raise PrivacyConfigError(
            f"cannot calibrate the noise multiplier for {where}: {stop}. A target this loose gives no meaningful "
            "privacy; lower target_epsilon, or pass noise_multiplier directly."
        ) from None
    except ValueError as err:  # Opacus: "The privacy budget is too low."
        raise PrivacyConfigError(f"cannot calibrate the noise multiplier for {where}: {err}") from None
    finally:
        _ACTIVE_GUARD.reset(token)

    achieved = _epsilon_of_history([(sigma, sample_rate, steps)], target_delta, accountant)
    if not (1.0 - epsilon_tolerance) * target_epsilon <= achieved <= target_epsilon * (1.0 + 1e-12):
        raise PrivacyConfigError(
            f"calibration for {where} ended at noise multiplier {sigma:.6g} with epsilon {achieved:.6g}, outside "
            f"the {epsilon_tolerance:.0%} tolerance; try accountant='rdp' or a larger epsilon_tolerance"
        )
    return float(sigma)


# ---- per-node ledger --------------------------------------------------------------------------------------------
class SubsampledGaussianAccountant(Accountant):
    """One node's privacy history ``[(sigma, q, steps), ...]`` and its epsilon, by an Opacus accountant.

    Consecutive identical ``(sigma, q)`` entries are merged, as in Opacus's accountants' ``history``. The epsilon of
    the whole history is the composition of the subsampled Gaussian steps (Mironov, Talwar, Zhang 2019 for
    ``"rdp"``; Gopi et al. 2021 for ``"prv"``).

    Args:
        accountant: ``"rdp"`` or ``"prv"`` (``"gdp"`` is refused: see :data:`GDP_REFUSAL`).
        delta: default delta for :meth:`epsilon` and :meth:`epsilon_after`.
    """

    def __init__(self, accountant: str = "rdp", delta: float | None = None) -> None:
        self.accountant = check_accountant(accountant)
        self.delta = None if delta is None else check_delta(delta)
        self.history: History = []
        self._cache: dict[tuple[Any, ...], float] = {}

    # -- recording
    @staticmethod
    def _append(history: History, noise_multiplier: float, sample_rate: float, steps: int) -> History:
        history = list(history)
        if history and history[-1][0] == noise_multiplier and history[-1][1] == sample_rate:
            sigma, q, count = history[-1]
            history[-1] = (sigma, q, count + steps)
        else:
            history.append((noise_multiplier, sample_rate, steps))
        return history

    def _extended(self, noise_multiplier: float, sample_rate: float, steps: int) -> History:
        noise_multiplier = check_noise_multiplier(noise_multiplier)
        sample_rate = check_sample_rate(sample_rate)
        steps = check_steps(steps, minimum=1)
        return self._append(self.history, noise_multiplier, sample_rate, steps)

    release_type = GaussianRelease

    def _record(self, release: GaussianRelease, steps: int) -> None:
        """Account for ``steps`` more steps with noise multiplier sigma and Poisson sampling rate q."""
        self.history = self._extended(release.noise_multiplier, release.sample_rate, steps)

    # -- queries
    @property
    def steps(self) -> int:
        """Number of recorded steps."""
        return sum(t for _, _, t in self.history)

    def _delta(self, delta: float | None) -> float:
        if delta is None:
            delta = self.delta
        if delta is None:
            raise PrivacyConfigError(f"no delta given: pass delta=... here or to {type(self).__name__}(delta=...)")
        return check_delta(delta)

    def _epsilon(self, history: History, delta: float) -> float:
        key = (tuple(history), delta)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = _epsilon_of_history(history, delta, self.accountant)
        return self._cache[key]

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the ledger's delta); 0.0 before any step."""
        return self._epsilon(self.history, self._delta(delta))

    def _epsilon_after(self, steps: int, release: GaussianRelease | None) -> float:
        """:class:`Accountant`'s query: epsilon after ``steps`` more steps at (sigma, q)."""
        if release is None:
            return self.epsilon()
        return self._epsilon(self._extended(release.noise_multiplier, release.sample_rate, steps), self._delta(None))

    # -- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain Python types only (loadable with ``torch.load(weights_only=True)``)."""
        return {
            "accountant": self.accountant,
            "delta": self.delta,
            "history": [[float(s), float(q), int(t)] for s, q, t in self.history],
        }

    def saved_steps(self, state: Mapping[str, Any]) -> int:
        self._check_state(state)
        return sum(int(t) for _, _, t in state["history"])

    def _check_state(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or "history" not in state or "accountant" not in state:
            raise PrivacyConfigError(
                "not a SubsampledGaussianAccountant state_dict (needs keys 'accountant' and 'history'); pass what "
                "SubsampledGaussianAccountant.state_dict() returned"
            )
        if state["accountant"] == "gdp":
            raise PrivacyConfigError(
                "this checkpoint's ledger was accounted with 'gdp', an approximation this library no longer uses: "
                f"re-account its history {state['history']} soundly with "
                "SubsampledGaussianAccountant('rdp').load_state_dict({**state, 'accountant': 'rdp'}) (the same "
                "(sigma, q, steps) entries), or start a new run"
            )
        if state["accountant"] != self.accountant:
            raise PrivacyConfigError(
                f"the saved ledger used accountant {state['accountant']!r} but this one uses {self.accountant!r}; "
                f"create SubsampledGaussianAccountant(accountant={state['accountant']!r}) to resume it"
            )

    def _load_state(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; later :meth:`record` calls continue the count."""
        self._check_state(state)
        history: History = []
        for sigma, q, t in _as_entries(state["history"]):
            history = self._append(
                history, check_noise_multiplier(sigma), check_sample_rate(q), check_steps(int(t), minimum=1)
            )
        self.history = history
        if state["delta"] is not None:
            self.delta = check_delta(state["delta"])
        self._cache.clear()

    def __repr__(self) -> str:
        return (f"SubsampledGaussianAccountant(accountant={self.accountant!r}, delta={self.delta!r}, "
                f"history={self.history!r})")


def _as_entries(entries: Iterable[Any]) -> Iterable[tuple[float, float, int]]:
    for entry in entries:
        sigma, q, t = entry
        yield float(sigma), float(q), int(t)

