"""Lightning strategies: one base class and one thin file per algorithm."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_privdec.strategies.base import DecentralizedStrategy
from lightning_privdec.strategies.flat_parameters import FlatParameters
from lightning_privdec.strategies.push_sum import DecentralizedPushSumStrategy, DecentralizedSGDStrategy

for _strategy in (DecentralizedPushSumStrategy, DecentralizedSGDStrategy):
    _strategy.register_strategies(StrategyRegistry)

__all__ = ["DecentralizedPushSumStrategy", "DecentralizedSGDStrategy", "DecentralizedStrategy", "FlatParameters"]
