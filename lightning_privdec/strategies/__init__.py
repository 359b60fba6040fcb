"""Lightning strategies: one base class and one thin file per algorithm."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_privdec.strategies.base import DecentralizedStrategy
from lightning_privdec.strategies.cpgt import CPGTStrategy
from lightning_privdec.strategies.decor import CorrelatedNoiseStrategy
from lightning_privdec.strategies.dp_csgp import DP2SGDStrategy, DPCSGPStrategy, PrivSGPStrategy
from lightning_privdec.strategies.dyn_d2p import DynD2PStrategy
from lightning_privdec.algorithms.flat_parameters import FlatParameters
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy
from lightning_privdec.strategies.privsgp_vr import PrivSGPVRStrategy
from lightning_privdec.strategies.push_sum import DecentralizedPushSumStrategy, DecentralizedSGDStrategy

for _strategy in (DecentralizedPushSumStrategy, DecentralizedSGDStrategy):
    _strategy.register_strategies(StrategyRegistry)

#: the strategies by the short names examples and command lines use
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

__all__ = [
    "CPGTStrategy",
    "NON_PRIVATE_STRATEGIES",
    "PRIVATE_STRATEGIES",
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
]
