"""lightning-privdec: private decentralized learning as PyTorch Lightning strategies."""

from lightning_privdec.compression import QSGD, Identity, RandK, Sign, TopK
from lightning_privdec.strategies import (
    DecentralizedPushSumStrategy,
    DecentralizedSGDStrategy,
    DecentralizedStrategy,
)
from lightning_privdec.topology import Topology, TopologyError, build_topology

__version__ = "0.1.0"

__all__ = [
    "QSGD",
    "DecentralizedPushSumStrategy",
    "DecentralizedSGDStrategy",
    "DecentralizedStrategy",
    "Identity",
    "RandK",
    "Sign",
    "TopK",
    "Topology",
    "TopologyError",
    "build_topology",
]
