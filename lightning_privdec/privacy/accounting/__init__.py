"""Accountants: one :class:`Accountant` interface, one implementation per mechanism, named ``<Mechanism>Accountant``.

* :class:`SubsampledGaussianAccountant` (:mod:`.gaussian`) - the Poisson-subsampled Gaussian of DP-SGD (Opacus's RDP
  and PRV accountants): DP-CSGP, PrivSGP, DP2-SGD;
* :class:`GaussianScheduleAccountant` (:mod:`.schedule`) - the same with a noise multiplier that changes every step:
  Dyn-D2P;
* :class:`CPGTAccountant` (:mod:`.cpgt`) - CPGT's decaying Laplace noise, pure epsilon-DP (Theorem 2 and the bound its
  proof gives);
* :class:`SagaAccountant` (:mod:`.saga`) - PrivSGP-VR's release, a subsampled and an always-present Gaussian per step
  (sound), or the paper's Theorem 2 for comparison;
* :class:`SecLDPAccountant` (:mod:`.secldp`) - Decor's correlated noise, SecLDP per round (:mod:`.secldp_step`)
  composed over rounds;

each states the release it records as a frozen dataclass (:class:`GaussianRelease`, :class:`LaplaceRelease`,
:class:`SagaRelease`, :class:`SecLDPRelease`), checked when recorded.
"""

from lightning_privdec.privacy.accounting.base import Accountant, largest_count, smallest_noise
from lightning_privdec.privacy.accounting.cpgt import CPGTAccountant, LaplaceRelease
from lightning_privdec.privacy.accounting.gaussian import (
    ACCOUNTANTS,
    GDP_REFUSAL,
    GaussianRelease,
    SubsampledGaussianAccountant,
    calibrate_noise_multiplier,
    check_accountant,
    epsilon_for,
    make_accountant,
)
from lightning_privdec.privacy.accounting.composition import gdp_epsilon_approximation
from lightning_privdec.privacy.accounting.saga import (
    SagaAccountant,
    SagaNoise,
    SagaRelease,
    saga_epsilon,
)
from lightning_privdec.privacy.accounting.saga_calibration import calibrate_saga_noise
from lightning_privdec.privacy.accounting.schedule import GaussianSchedule, GaussianScheduleAccountant
from lightning_privdec.privacy.accounting.secldp import SecLDPAccountant, SecLDPRelease

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "CPGTAccountant",
    "GDP_REFUSAL",
    "GaussianRelease",
    "GaussianSchedule",
    "GaussianScheduleAccountant",
    "LaplaceRelease",
    "SagaAccountant",
    "SagaNoise",
    "SagaRelease",
    "SecLDPAccountant",
    "SecLDPRelease",
    "SubsampledGaussianAccountant",
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
