"""Accountants: one :class:`Accountant` interface, one implementation per mechanism.

* :mod:`.gaussian` - the Poisson-subsampled Gaussian of DP-SGD (Opacus's RDP and PRV accountants): DP-CSGP, PrivSGP,
  DP2-SGD;
* :mod:`.cpgt` - CPGT's decaying Laplace noise, pure epsilon-DP (Theorem 2's coupling);
"""

from lightning_privdec.privacy.accounting.base import Accountant, largest_count, smallest_noise
from lightning_privdec.privacy.accounting.cpgt import CPGTAccountant, LaplaceRounds
from lightning_privdec.privacy.accounting.gaussian import (
    ACCOUNTANTS,
    GDP_REFUSAL,
    PrivacyLedger,
    calibrate_noise_multiplier,
    check_accountant,
    epsilon_for,
    gdp_epsilon_approximation,
    make_accountant,
)

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "CPGTAccountant",
    "GDP_REFUSAL",
    "LaplaceRounds",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "check_accountant",
    "epsilon_for",
    "gdp_epsilon_approximation",
    "largest_count",
    "make_accountant",
    "smallest_noise",
]
