"""Accountants: one :class:`Accountant` interface, one implementation per mechanism.

* :mod:`.gaussian` - the Poisson-subsampled Gaussian of DP-SGD (Opacus's RDP and PRV accountants): DP-CSGP, PrivSGP,
  DP2-SGD;
* :mod:`.cpgt` - CPGT's decaying Laplace noise, pure epsilon-DP (Theorem 2 and the bound its proof gives);
* :mod:`.saga` - PrivSGP-VR's release, a subsampled and an always-present Gaussian per step (sound), or the paper's
  Theorem 2 for comparison;
"""

from lightning_privdec.privacy.accounting.base import Accountant, largest_count, smallest_noise
from lightning_privdec.privacy.accounting.cpgt import CPGTAccountant
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
from lightning_privdec.privacy.accounting.saga import SagaAccountant, SagaNoise, calibrate_saga_noise, saga_epsilon

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "CPGTAccountant",
    "GDP_REFUSAL",
    "PrivacyLedger",
    "SagaAccountant",
    "SagaNoise",
    "calibrate_noise_multiplier",
    "calibrate_saga_noise",
    "check_accountant",
    "epsilon_for",
    "gdp_epsilon_approximation",
    "largest_count",
    "make_accountant",
    "saga_epsilon",
    "smallest_noise",
]
