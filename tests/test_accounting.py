"""The accountants' pure computations are cached: a repeated question (every node calibrating the same budget, a
budget check at the same history) is answered from the cache with the value the computation gives."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_privdec.privacy.accounting import gaussian, saga, secldp
from lightning_privdec.privacy.accounting.gaussian import calibrate_noise_multiplier, epsilon_for
from lightning_privdec.privacy.errors import PrivacyConfigError


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


def test_the_cached_saga_rdp_is_read_only_and_equal_to_the_computation() -> None:
    cached = saga._quiet_rdp(0.05, 1.3, 25)
    assert cached is saga._quiet_rdp(0.05, 1.3, 25)
    np.testing.assert_array_equal(cached, saga._subsampled_gaussian_rdp(0.05, 1.3, 25))
    with pytest.raises(ValueError, match="read-only"):
        cached[0] = 0.0


def test_a_repeated_example_level_secldp_search_is_a_cache_hit() -> None:
    step = secldp._example_eps_step_for(3.0, 40, 1e-5, 0.1, None)
    hits = secldp._example_eps_step_for.cache_info().hits
    assert secldp._example_eps_step_for(3.0, 40, 1e-5, 0.1, None) == step
    assert secldp._example_eps_step_for.cache_info().hits == hits + 1
    assert step == secldp._example_eps_step_for.__wrapped__(3.0, 40, 1e-5, 0.1, None)
    assert secldp.secldp_epsilon_example_level(step, 40, 1e-5, 0.1) <= 3.0


def test_the_cached_step_rdp_composes_to_opacus_rdp_accountant_exactly() -> None:
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    step = gaussian.subsampled_gaussian_rdp(0.02, 1.1)
    assert step is gaussian.subsampled_gaussian_rdp(0.02, 1.1)
    np.testing.assert_array_equal(
        step * 30, compute_rdp(q=0.02, noise_multiplier=1.1, steps=30, orders=RDPAccountant.DEFAULT_ALPHAS)
    )
    with pytest.raises(ValueError, match="read-only"):
        step[0] = 0.0
    example_level = secldp.secldp_epsilon_example_level(0.05, 40, 1e-5, 0.1)
    assert example_level == secldp.secldp_epsilon_example_level(
        0.05, 40, 1e-5, 0.1, orders=list(RDPAccountant.DEFAULT_ALPHAS)
    )


def test_the_prv_accountant_with_cached_domain_bounds_gives_opacus_numbers() -> None:
    from opacus.accountants import PRVAccountant
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV

    history = [(1.3, 0.05, 40), (0.9, 0.05, 5)]
    cached, opacus = gaussian.make_accountant("prv"), PRVAccountant()
    assert isinstance(cached, gaussian.CachedPRVAccountant)
    cached.history, opacus.history = list(history), list(history)
    hits = gaussian.subsampled_gaussian_rdp.cache_info().hits
    assert cached.get_epsilon(delta=1e-5) == opacus.get_epsilon(delta=1e-5)
    assert gaussian.subsampled_gaussian_rdp.cache_info().hits > hits
    for steps, delta_error in ((45, 1e-8), (3, 1e-10)):
        prvs = [PoissonSubsampledGaussianPRV(0.05, 1.3)]
        mine = cached._get_domain(prvs, [steps], 0.01, delta_error)
        theirs = opacus._get_domain(prvs, [steps], 0.01, delta_error)
        assert (mine.t_min, mine.t_max, mine.size) == (theirs.t_min, theirs.t_max, theirs.size)
