"""One interface for every accountant: what a node has released, and what it has spent.

In the spirit of Opacus's ``IAccountant`` (``step``, ``get_epsilon``, ``state_dict``), one node's accountant records
each private step's release and answers, at its ``delta``:

* :meth:`Accountant.epsilon` - spent so far;
* :meth:`Accountant.epsilon_after` - spent after ``n`` more steps releasing ``release`` each (budget checks and
  calibration ask this before anything leaves the node);
* :meth:`Accountant.steps_within` - how many more such steps fit into a target (written once here: a doubling and
  bisection search, valid because epsilon never decreases with more steps);
* :meth:`Accountant.state_dict` / :meth:`Accountant.load_state_dict` - checkpoints, with the never-roll-back guard
  written once here: a saved state with fewer steps than this accountant has recorded is refused.

What a release is depends on the mechanism; each accountant states it as a small frozen dataclass, its
:attr:`Accountant.release_type`, which checks its values when built and which :meth:`Accountant.record` checks the
type of: :class:`~.gaussian.GaussianRelease` ``(sigma, q)`` for the subsampled Gaussian (:mod:`.gaussian`, and
Dyn-D2P's varying multipliers in :mod:`.schedule`), :class:`~.saga.SagaRelease` (several such mechanisms) for
PrivSGP-VR's split, :class:`~.secldp.SecLDPRelease` (one round of correlated noise) for Decor,
:class:`~.cpgt.LaplaceRelease` (one round of decaying Laplace noise) for CPGT.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from lightning_privdec.privacy.errors import PrivacyConfigError


def golden_section_min(f: Callable[[float], float], lo: float, hi: float, tol: float = 1e-4, iters: int = 80) -> float:
    """Argmin of a unimodal f on [lo, hi] (golden section; +inf plateaus on the left move the search right)."""
    inv = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = hi - inv * (hi - lo), lo + inv * (hi - lo)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if hi - lo < tol:
            break
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - inv * (hi - lo)
            fc = f(c)
        else:
            lo, c, fc = c, d, fd
            d = lo + inv * (hi - lo)
            fd = f(d)
    return (lo + hi) / 2.0


#: the most further steps :meth:`Accountant.steps_within` ever reports (a budget no run can spend)
UNLIMITED_STEPS = 1 << 40


class Accountant(ABC):
    """One node's ledger of one mechanism. Subclasses set :attr:`release_type` and implement :meth:`_record`,
    :attr:`steps`, :meth:`_epsilon_after`, :meth:`state_dict`, :meth:`saved_steps` and :meth:`_load_state`; the
    rest is shared."""

    #: the delta at which epsilon is reported (0 for pure epsilon-DP)
    delta: float | None = None
    #: what one private step releases, as this accountant takes it (a frozen dataclass that checks its own values)
    release_type: ClassVar[type]

    def check_release(self, release: Any) -> Any:
        """``release`` if it is a :attr:`release_type`; else a TypeError naming what this accountant takes."""
        if not isinstance(release, self.release_type):
            raise TypeError(
                f"{type(self).__name__} accounts for one {self.release_type.__name__} per private step "
                f"(fields: {', '.join(self.release_type.__dataclass_fields__)}), got {release!r}"
            )
        return release

    def record(self, release: Any, steps: int = 1) -> None:
        """Account for ``steps`` private steps that released ``release`` each (checked: :meth:`check_release`)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        self._record(self.check_release(release), steps)

    @abstractmethod
    def _record(self, release: Any, steps: int) -> None:
        """Account for ``steps`` steps releasing ``release`` (a checked :attr:`release_type`)."""

    @property
    @abstractmethod
    def steps(self) -> int:
        """Private steps recorded so far."""

    def epsilon_after(self, steps: int, release: Any = None) -> float:
        """Epsilon after ``steps`` more hypothetical steps releasing ``release`` each (``steps = 0``: spent so far,
        no release needed)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
        return self._epsilon_after(steps, self.check_release(release) if steps else None)

    @abstractmethod
    def _epsilon_after(self, steps: int, release: Any) -> float:
        """:meth:`epsilon_after` with a checked release (None when ``steps`` is 0)."""

    def epsilon(self) -> float:
        """Epsilon spent so far, at :attr:`delta`."""
        return self.epsilon_after(0)

    def metrics(self) -> dict[str, float]:
        """What the budget callback logs for this node (``privacy/<key>``); mechanisms may add their own keys."""
        return {"epsilon": self.epsilon()}

    def steps_within(self, target: float, release: Any, limit: int | None = None) -> int:
        """The largest n (at most ``limit``) such that n more steps releasing ``release`` keep epsilon <= target."""
        return largest_count(lambda n: self.epsilon_after(n, release) <= target, limit)

    # ---- checkpoints -------------------------------------------------------------------------------------------------
    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Plain Python types only (loadable with ``torch.load(weights_only=True)``)."""

    @abstractmethod
    def saved_steps(self, state: Mapping[str, Any]) -> int:
        """The number of steps a :meth:`state_dict` holds."""

    @abstractmethod
    def _load_state(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (called after the roll-back check)."""

    def load_state_dict(self, state: Mapping[str, Any], *, owner: str = "this node") -> None:
        """Continue a saved ledger. Never rolls back: a state with fewer steps than already recorded is refused."""
        saved = self.saved_steps(state)
        if saved < self.steps:
            raise PrivacyConfigError(
                f"{owner}: the checkpoint's privacy ledger has {saved} steps but {self.steps} have already been "
                "spent; restoring it would forget spent privacy. Resume into a fresh Trainer."
            )
        self._load_state(state)


def largest_count(fits: Callable[[int], bool], limit: int | None = None) -> int:
    """The largest n in [0, limit] with ``fits(n)``, for a ``fits`` that holds at 0 and, once false, stays false.

    Checks ``limit`` first (a plan that fits whole costs one evaluation), else doubles from 1 and bisects.
    """
    if limit is not None:
        if limit <= 0:
            return 0
        if fits(limit):
            return limit
    if not fits(1):
        return 0
    low, high = 1, 2  # fits(low); grow high until it fails (or reaches limit, known to fail)
    while limit is None or high < limit:
        if not fits(high):
            break
        low, high = high, high * 2
        if high > UNLIMITED_STEPS:
            return UNLIMITED_STEPS
    else:
        high = limit
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def smallest_noise(
    fits: Callable[[float], bool], *, low: float, high: float, rtol: float, most: float, where: str
) -> float:
    """The smallest noise level (within ``rtol`` of ``high``) for which ``fits`` holds, for a ``fits`` that, once
    true, stays true for more noise: ``high`` doubles until it fits (refused past ``most``), then bisection."""
    while not fits(high):
        high *= 2.0
        if high > most:
            raise PrivacyConfigError(f"no noise level up to {most:g} fits {where}")
    while high - low > rtol * high:
        middle = (low + high) / 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high
