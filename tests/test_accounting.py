"""The DP-SGD accountants (lightning_privdec.privacy.accounting.gaussian): calibration, Opacus's numbers, the ledger,
GDP shown only as an approximation, each accountant's release; and their caches: a repeated question (every node
calibrating the same budget, a budget check at the same history) is answered from the cache with the value the
computation gives."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant

from lightning_privdec import (
    CorrelatedNoiseStrategy,
    CPGTStrategy,
    DP2SGDStrategy,
    DPCSGPStrategy,
    DynD2PStrategy,
    PrivSGPStrategy,
    PrivSGPVRStrategy,
)
from lightning_privdec.privacy import ACCOUNTANTS, SubsampledGaussianAccountant, PrivacyParameters, make_accountant
from lightning_privdec.privacy.accounting import GaussianRelease, gaussian, saga, secldp
from lightning_privdec.privacy.accounting.gaussian import (
    calibrate_noise_multiplier,
    epsilon_for,
)
from lightning_privdec.privacy.accounting.composition import gdp_epsilon_approximation
from lightning_privdec.privacy.errors import PrivacyConfigError

pytestmark = [
    pytest.mark.filterwarnings("ignore:GDP accounting is experimental"),
    pytest.mark.filterwarnings("ignore:the 'gdp' accountant"),
    pytest.mark.filterwarnings("ignore:Optimal order is the"),
]


def test_a_repeated_calibration_is_a_cache_hit_with_the_searched_value() -> None:
    arguments = (2.5, 1e-5, 0.03, 70, "rdp")
    sigma = calibrate_noise_multiplier(*arguments)
    hits = gaussian._calibrated_noise_multiplier.cache_info().hits
    assert calibrate_noise_multiplier(*arguments) == sigma
    assert gaussian._calibrated_noise_multiplier.cache_info().hits == hits + 1
    searched = gaussian._calibrated_noise_multiplier.__wrapped__(*arguments, 0.01)
    assert searched == sigma
    assert 0.99 * 2.5 <= epsilon_for(sigma, 0.03, 70, 1e-5) <= 2.5


def test_a_repeated_epsilon_is_a_cache_hit_equal_to_opacus_and_the_history_is_normalised() -> None:
    history = [(1.1, 0.02, 30), (0.9, 0.02, 10)]
    epsilon = gaussian._epsilon_of_history(history, 1e-5, "rdp")
    hits = gaussian._composed_epsilon.cache_info().hits
    assert gaussian._epsilon_of_history([(1.1, 0.02, 30), (0.9, 0.02, 10), (5.0, 0.02, 0)], 1e-5, "rdp") == epsilon
    assert gaussian._composed_epsilon.cache_info().hits == hits + 1
    opacus = gaussian.make_accountant("rdp")
    opacus.history = list(history)
    assert epsilon == opacus.get_epsilon(delta=1e-5)


@pytest.mark.filterwarnings("ignore:Optimal order is the")
def test_an_invalid_calibration_is_refused_every_time_not_cached() -> None:
    for _ in range(2):
        with pytest.raises(PrivacyConfigError, match="cannot reach"):
            calibrate_noise_multiplier(1e-9, 1e-12, 1.0, 10_000)


def test_the_saga_rdp_is_the_cached_step_rdp_composed() -> None:
    from opacus.accountants.analysis.rdp import compute_rdp

    hits = gaussian.cached_step_rdp.cache_info().hits
    np.testing.assert_allclose(saga.gaussian_rdp(0.05, 1.3, 25), saga.gaussian_rdp(0.05, 1.3, 1) * 25, rtol=1e-15)
    assert gaussian.cached_step_rdp.cache_info().hits > hits
    np.testing.assert_allclose(saga.gaussian_rdp(0.05, 1.3, 25),
                               compute_rdp(q=0.05, noise_multiplier=1.3, steps=25, orders=saga.OPACUS_ORDERS), rtol=1e-12)
    assert not saga.gaussian_rdp(0.05, 1.3, 0).any()


def test_a_repeated_example_level_secldp_search_is_a_cache_hit() -> None:
    step = secldp._example_eps_step_for(3.0, 40, 1e-5, 0.1, None)
    hits = secldp._example_eps_step_for.cache_info().hits
    assert secldp._example_eps_step_for(3.0, 40, 1e-5, 0.1, None) == step
    assert secldp._example_eps_step_for.cache_info().hits == hits + 1
    assert step == secldp._example_eps_step_for.__wrapped__(3.0, 40, 1e-5, 0.1, None)
    assert secldp.secldp_epsilon_example_level(step, 40, 1e-5, 0.1) <= 3.0


def test_the_cached_step_rdp_composes_to_opacus_rdp_accountant() -> None:
    """The closed form at Opacus's integer orders and Opacus's series at its fractional ones: Opacus's numbers up to
    the rounding of the two formulas."""
    from opacus.accountants.analysis.rdp import compute_rdp

    step = gaussian.cached_step_rdp(0.02, 1.1)
    assert step is gaussian.cached_step_rdp(0.02, 1.1)
    np.testing.assert_allclose(
        step * 30, compute_rdp(q=0.02, noise_multiplier=1.1, steps=30, orders=RDPAccountant.DEFAULT_ALPHAS),
        rtol=1e-12, atol=0,
    )
    with pytest.raises(ValueError, match="read-only"):
        step[0] = 0.0
    example_level = secldp.secldp_epsilon_example_level(0.05, 40, 1e-5, 0.1)
    assert example_level == pytest.approx(secldp.secldp_epsilon_example_level(
        0.05, 40, 1e-5, 0.1, orders=list(RDPAccountant.DEFAULT_ALPHAS)
    ), rel=1e-12)


def test_the_prv_accountant_with_cached_domain_bounds_gives_opacus_numbers() -> None:
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV

    history = [(1.3, 0.05, 40), (0.9, 0.05, 5)]
    cached, opacus = gaussian.make_accountant("prv"), PRVAccountant()
    assert isinstance(cached, gaussian.CachedPRVAccountant)
    cached.history, opacus.history = list(history), list(history)
    hits = gaussian.cached_step_rdp.cache_info().hits
    assert cached.get_epsilon(delta=1e-5) == opacus.get_epsilon(delta=1e-5)
    assert gaussian.cached_step_rdp.cache_info().hits > hits
    for steps, delta_error in ((45, 1e-8), (3, 1e-10)):
        prvs = [PoissonSubsampledGaussianPRV(0.05, 1.3)]
        mine = cached._get_domain(prvs, [steps], 0.01, delta_error)
        theirs = opacus._get_domain(prvs, [steps], 0.01, delta_error)
        assert (mine.t_min, mine.t_max, mine.size) == (theirs.t_min, theirs.t_max, theirs.size)


@pytest.mark.parametrize(
    ("accountant", "target", "q", "steps"),
    [
        ("rdp", 1.0, 0.01, 1000),
        ("rdp", 3.0, 0.004, 2000),
        ("rdp", 8.0, 0.1, 100),
        ("prv", 1.0, 0.02, 300),
        ("prv", 4.0, 0.05, 200),
    ],
)
def test_calibration_hits_the_target_within_one_percent(accountant: str, target: float, q: float, steps: int) -> None:
    sigma = calibrate_noise_multiplier(target, 1e-5, q, steps, accountant=accountant)
    achieved = epsilon_for(sigma, q, steps, 1e-5, accountant=accountant)
    assert 0.99 * target <= achieved <= target


def test_calibration_refuses_unreachable_targets_quickly() -> None:
    with pytest.raises(PrivacyConfigError, match="cannot reach .* floor"):
        calibrate_noise_multiplier(0.01, 1e-5, 0.01, 1000)  # below RDP's conversion floor even with sigma = 1e6
    with pytest.raises(PrivacyConfigError, match="cannot calibrate"):
        calibrate_noise_multiplier(1e9, 1e-5, 0.01, 1000)  # a target this loose needs no noise
    with pytest.raises(PrivacyConfigError, match="target_epsilon must be a finite number > 0"):
        calibrate_noise_multiplier(0.0, 1e-5, 0.01, 1000)
    with pytest.raises(PrivacyConfigError, match="unknown accountant 'moments'.*'rdp', 'prv'"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 1000, accountant="moments")


@pytest.mark.parametrize("opacus_cls", [RDPAccountant, PRVAccountant])
def test_epsilon_for_equals_opacus_accountants(opacus_cls: type) -> None:
    sigma, q, steps, delta = 1.1, 0.02, 150, 1e-5
    reference = opacus_cls()
    for _ in range(steps):
        reference.step(noise_multiplier=sigma, sample_rate=q)
    name = reference.mechanism()
    assert epsilon_for(sigma, q, steps, delta, accountant=name) == pytest.approx(reference.get_epsilon(delta),
                                                                                  rel=1e-9)
    ledger = SubsampledGaussianAccountant(name, delta=delta)
    for _ in range(steps):
        ledger.record(GaussianRelease(sigma, q))
    assert ledger.history == [(sigma, q, steps)] == reference.history
    assert ledger.epsilon() == pytest.approx(reference.get_epsilon(delta), rel=1e-9)
    assert isinstance(make_accountant(name), opacus_cls)


def test_ledger_with_a_schedule_matches_opacus_rdp() -> None:
    reference, ledger = RDPAccountant(), SubsampledGaussianAccountant("rdp")
    schedule = [(1.0, 0.01)] * 30 + [(0.8, 0.02)] * 20 + [(1.0, 0.01)] * 10
    for sigma, q in schedule:
        reference.step(noise_multiplier=sigma, sample_rate=q)
        ledger.record(GaussianRelease(sigma, q))
    assert ledger.history == reference.history and len(ledger.history) == 3 and ledger.steps == 60
    assert ledger.epsilon(1e-6) == pytest.approx(reference.get_epsilon(1e-6), rel=1e-12)


# The review's grid: GDP's central-limit epsilon against the tight PLD value (dp_accounting), and what calibrating
# to GDP would have given. Each case is one where GDP under-estimates epsilon.
@pytest.mark.parametrize(("sigma", "q", "steps", "gdp_epsilon", "tight_epsilon"), [(0.5, 0.001, 10, 0.069, 1.086)])
def test_gdp_is_shown_as_an_approximation_and_never_decides(sigma, q, steps, gdp_epsilon, tight_epsilon) -> None:
    assert gdp_epsilon_approximation(sigma, q, steps, 1e-5) == pytest.approx(gdp_epsilon, abs=2e-3)
    sound = epsilon_for(sigma, q, steps, 1e-5, accountant="prv")
    assert sound >= tight_epsilon * 0.99  # the sound accountant does not under-estimate
    for refused in (
        lambda: SubsampledGaussianAccountant("gdp", delta=1e-5),
        lambda: epsilon_for(sigma, q, steps, 1e-5, accountant="gdp"),
        lambda: calibrate_noise_multiplier(2.0, 1e-5, q, steps, accountant="gdp"),
        lambda: PrivacyParameters(max_grad_norm=1.0, target_epsilon=2.0, target_delta=1e-5, accountant="gdp").validate(),
    ):
        with pytest.raises(PrivacyConfigError, match="accountant='gdp' is refused.*central-limit approximation.*'rdp'"):
            refused()


def test_every_private_strategy_refuses_gdp_when_built() -> None:
    budget = dict(max_grad_norm=1.0, target_epsilon=2.0, target_delta=1e-5, accountant="gdp")
    for build in (
        lambda: DPCSGPStrategy(**budget),
        lambda: PrivSGPStrategy(**budget),
        lambda: DP2SGDStrategy(**budget),
        lambda: PrivSGPVRStrategy(**budget),
        lambda: CPGTStrategy(noise_decay=0.9, lipschitz=1.0, **budget),
        lambda: CorrelatedNoiseStrategy(**budget),
    ):
        with pytest.raises(PrivacyConfigError, match="gdp"):
            build()
    with pytest.raises(PrivacyConfigError, match="CLT approximation"):
        DynD2PStrategy(**budget)


def test_ledger_state_dict_round_trip_continues_the_count() -> None:
    ledger = SubsampledGaussianAccountant("rdp", delta=1e-5)
    assert ledger.epsilon() == 0.0 and ledger.steps == 0
    ledger.record(GaussianRelease(1.2, 0.01), steps=100)
    ledger.record(GaussianRelease(1.0, 0.01), steps=50)
    buffer = io.BytesIO()
    torch.save(ledger.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    resumed = SubsampledGaussianAccountant("rdp")
    resumed.load_state_dict(state)
    assert resumed.steps == 150 and resumed.delta == 1e-5
    assert resumed.epsilon() == pytest.approx(ledger.epsilon(), rel=1e-12)
    resumed.record(GaussianRelease(1.0, 0.01))
    assert resumed.steps == 151 and resumed.history[-1] == (1.0, 0.01, 51)
    with pytest.raises(PrivacyConfigError, match="accountant 'rdp'"):
        SubsampledGaussianAccountant("prv").load_state_dict(state)


def test_epsilon_after_looks_ahead_without_recording() -> None:
    ledger = SubsampledGaussianAccountant("rdp", delta=1e-5)
    ledger.record(GaussianRelease(1.0, 0.01), steps=100)
    now = ledger.epsilon()
    ahead = ledger.epsilon_after(10, GaussianRelease(1.0, 0.01))
    assert ahead > now and ledger.steps == 100
    assert ahead == pytest.approx(epsilon_for(1.0, 0.01, 110, 1e-5))
    assert ledger.epsilon_after(1, GaussianRelease(1.0, 0.01)) < ahead
    with pytest.raises(PrivacyConfigError, match="no delta"):
        SubsampledGaussianAccountant("rdp").epsilon()


def test_zero_noise_has_infinite_epsilon() -> None:
    for name in ACCOUNTANTS:
        assert epsilon_for(0.0, 0.01, 10, 1e-5, accountant=name) == math.inf


def test_each_accountant_records_only_its_own_release_with_sound_values():
    """A release is a frozen dataclass per mechanism: a bad value is refused when it is built, a release of another
    mechanism (or a bare tuple) when it is recorded; neither changes the ledger."""
    from lightning_privdec.privacy.accounting import (
        CPGTAccountant,
        LaplaceRelease,
        SubsampledGaussianAccountant,
        SagaAccountant,
        SagaRelease,
        SecLDPAccountant,
        SecLDPRelease,
    )

    for bad in [(-1.0, 0.1), (1.0, 0.0), (1.0, 1.5), (float("nan"), 0.1), ("1", 0.1)]:
        with pytest.raises(ValueError, match="noise_multiplier|sample_rate"):
            GaussianRelease(*bad)
    with pytest.raises(ValueError, match="epsilon_step"):
        SecLDPRelease(-0.1)
    with pytest.raises(TypeError, match="GaussianRelease"):
        SagaRelease(((1.0, 0.1),))
    with pytest.raises(ValueError, match="noise_decay"):
        LaplaceRelease(1.0, 1.0, 0.0)

    gaussian = SubsampledGaussianAccountant("rdp", delta=1e-5)
    saga, secldp = SagaAccountant("rdp", 1e-5), SecLDPAccountant(1e-5, "user")
    for ledger, wrong in [(gaussian, (1.0, 0.1)), (gaussian, SecLDPRelease(0.1)), (saga, GaussianRelease(1.0, 0.1)),
                          (secldp, GaussianRelease(1.0, 0.1))]:
        with pytest.raises(TypeError, match=f"{type(ledger).__name__} accounts for one {ledger.release_type.__name__}"):
            ledger.record(wrong)
        with pytest.raises(TypeError, match=ledger.release_type.__name__):
            ledger.epsilon_after(3, wrong)
        assert ledger.steps == 0
    gaussian.record(GaussianRelease(1.0, 0.1), steps=2)
    saga.record(SagaRelease.of([(1.0, 0.1), (2.0, 1.0)]))
    secldp.record(SecLDPRelease(0.01))
    assert (gaussian.steps, saga.steps, secldp.steps) == (2, 1, 1)
    with pytest.raises(ValueError, match="steps"):
        gaussian.record(GaussianRelease(1.0, 0.1), steps=0)

    cpgt = CPGTAccountant("sound")
    with pytest.raises(PrivacyConfigError, match="configure first"):
        cpgt.record(LaplaceRelease(1.0, 1.0, 0.9))
    cpgt.configure(alpha=0.1, lipschitz=1.0, q=0.9, noise_x=1.0, noise_y=1.0, sensitivity=1.0, norm_factor=1.0)
    with pytest.raises(PrivacyConfigError, match="differs from the noise the ledger accounts for"):
        cpgt.record(LaplaceRelease(2.0, 1.0, 0.9))
    cpgt.record(LaplaceRelease(1.0, 1.0, 0.9))
    assert cpgt.steps == 1
