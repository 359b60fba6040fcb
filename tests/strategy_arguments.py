"""Small valid arguments of every registered strategy, shared by the tests and benchmarks/compatibility.py.

CPGT uses finite accounting, which accepts mini-batches. The module imports nothing from the library, so a benchmark
can import it before any torch import (``sys.path`` holding the repository root: ``from tests.strategy_arguments
import ...``); tests/test_strategy_modes.py checks that the private table names every private strategy.
"""

from __future__ import annotations

from typing import Any

#: every private strategy's arguments (a noise level, or a budget where the strategy takes no noise level)
PRIVATE_STRATEGY_ARGUMENTS: dict[str, dict[str, Any]] = {
    "dp_csgp": dict(max_grad_norm=1.0, noise_multiplier=1.0),
    "privsgp": dict(max_grad_norm=1.0, noise_multiplier=1.0),
    "dp2sgd": dict(max_grad_norm=1.0, noise_multiplier=1.0),
    "decor": dict(max_grad_norm=1.0, sigma_cdp=1.0, sigma_cor=1.0),
    "dyn_d2p": dict(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5),
    "privsgp_vr": dict(max_grad_norm=1.0, noise_multiplier=1.0),
    "cpgt": dict(max_grad_norm=1.0, noise_x=0.1, noise_y=0.1, noise_decay=0.9, lipschitz=0.1, accounting="finite"),
}

#: every registered strategy's arguments, the non-private ones included
STRATEGY_ARGUMENTS: dict[str, dict[str, Any]] = {"push_sum": dict(), "dpsgd": dict(), **PRIVATE_STRATEGY_ARGUMENTS}
