"""Lightning strategies: one base class and one thin file per algorithm."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_privdec.strategies.base import DecentralizedStrategy
from lightning_privdec.strategies.dp_csgp import DP2SGDStrategy, DPCSGPStrategy, PrivSGPStrategy
from lightning_privdec.strategies.flat_parameters import FlatParameters
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy
from lightning_privdec.strategies.push_sum import DecentralizedPushSumStrategy, DecentralizedSGDStrategy

for _strategy in (DecentralizedPushSumStrategy, DecentralizedSGDStrategy):
    _strategy.register_strategies(StrategyRegistry)

__all__ = [
    "DP2SGDStrategy",
    "DPCSGPStrategy",
    "DecentralizedPushSumStrategy",
    "DecentralizedSGDStrategy",
    "DecentralizedStrategy",
    "FlatParameters",
    "PrivSGPStrategy",
    "PrivateDecentralizedStrategy",
]
