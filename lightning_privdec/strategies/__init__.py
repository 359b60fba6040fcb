"""Lightning strategies: the base classes (process_group.py, base.py, private.py) with their helpers, and one thin file
per algorithm."""

from functools import partial

from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_privdec.privacy import PrivacyConfigError

from lightning_privdec.strategies.base import DecentralizedStrategy
from lightning_privdec.strategies.cpgt import CPGTStrategy
from lightning_privdec.strategies.decor import CorrelatedNoiseStrategy
from lightning_privdec.strategies.dp_csgp import DP2SGDStrategy, DPCSGPStrategy, PrivSGPStrategy
from lightning_privdec.strategies.dyn_d2p import DynD2PStrategy
from lightning_privdec.algorithms.flat_parameters import FlatParameters
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy
from lightning_privdec.strategies.privsgp_vr import PrivSGPVRStrategy
from lightning_privdec.strategies.push_sum import DecentralizedPushSumStrategy, DecentralizedSGDStrategy

#: the strategies by the short names examples, command lines and ``Trainer(strategy="<name>")`` use
NON_PRIVATE_STRATEGIES = {"push_sum": DecentralizedPushSumStrategy, "dpsgd": DecentralizedSGDStrategy}
PRIVATE_STRATEGIES = {
    "dp_csgp": DPCSGPStrategy,
    "privsgp": PrivSGPStrategy,
    "dp2sgd": DP2SGDStrategy,
    "decor": CorrelatedNoiseStrategy,
    "dyn_d2p": DynD2PStrategy,
    "privsgp_vr": PrivSGPVRStrategy,
    "cpgt": CPGTStrategy,
}
STRATEGIES = {**NON_PRIVATE_STRATEGIES, **PRIVATE_STRATEGIES}
#: the privacy a private strategy gets from its name alone: the README quick start's clip and budget (stated at once)
NAME_ONLY_PRIVACY = {"max_grad_norm": 1.0, "target_epsilon": 3.0, "target_delta": 1e-5}


def strategy_by_name(name: str, start_method: str = "popen") -> DecentralizedStrategy:
    """The strategy ``Trainer(strategy=name)`` builds: the class's defaults and, for a private one,
    :data:`NAME_ONLY_PRIVACY`, stated once; CPGT, whose epsilon rests on a constant only the user can state, is
    refused with the call to write instead."""
    cls = STRATEGIES[name]
    if name not in PRIVATE_STRATEGIES:
        return cls(start_method=start_method)
    budget = ", ".join(f"{k}={v!r}" for k, v in NAME_ONLY_PRIVACY.items())
    if cls is CPGTStrategy:
        raise PrivacyConfigError(
            f"strategy={name!r} needs an argument a name cannot carry: CPGT's epsilon holds only if the loss is "
            "L-smooth with the L you state (lipschitz=...), and the strategy has no default L. Pass "
            f"strategy=CPGTStrategy(lipschitz=..., {budget}) instead (docs/privacy.md, 'CPGT')."
        )
    strategy = cls(**NAME_ONLY_PRIVACY, start_method=start_method)
    rank_zero_info(
        f"strategy={name!r} is {cls.__name__} with {budget} (the README's quick start; sigma is calibrated for the "
        f"planned steps). To choose them, pass strategy={cls.__name__}(max_grad_norm=..., target_epsilon=..., "
        "target_delta=...)."
    )
    return strategy


for _name, _cls in STRATEGIES.items():
    for _suffix, _start_method in (("", "popen"), ("_spawn", "spawn")):
        StrategyRegistry.register(
            _name + _suffix, partial(strategy_by_name, _name, _start_method), override=True,
            description=f"{_cls.__name__} with start_method {_start_method!r}",
        )

__all__ = [
    "CPGTStrategy",
    "NON_PRIVATE_STRATEGIES",
    "PRIVATE_STRATEGIES",
    "NAME_ONLY_PRIVACY",
    "STRATEGIES",
    "CorrelatedNoiseStrategy",
    "DP2SGDStrategy",
    "DPCSGPStrategy",
    "DecentralizedPushSumStrategy",
    "DecentralizedSGDStrategy",
    "DecentralizedStrategy",
    "DynD2PStrategy",
    "FlatParameters",
    "PrivSGPStrategy",
    "PrivSGPVRStrategy",
    "PrivateDecentralizedStrategy",
    "strategy_by_name",
]
