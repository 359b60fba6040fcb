"""lightning-privdec: private decentralized learning as PyTorch Lightning strategies."""

from lightning_privdec.callbacks import PrivacyBudgetCallback
from lightning_privdec.comm.distributed import PeerFailureError
from lightning_privdec.compression import QSGD, Identity, RandK, Sign, TopK
from lightning_privdec.privacy import PrivacyConfigError
from lightning_privdec.strategies import (
    CPGTStrategy,
    CorrelatedNoiseStrategy,
    DecentralizedPushSumStrategy,
    DecentralizedSGDStrategy,
    DecentralizedStrategy,
    DP2SGDStrategy,
    DPCSGPStrategy,
    DynD2PStrategy,
    PrivSGPStrategy,
    PrivSGPVRStrategy,
)
from lightning_privdec.strategies.checks import NodeMismatchError, NonFiniteStepError
from lightning_privdec.strategies.divergence import DivergenceError
from lightning_privdec.topology import Topology, TopologyError, build_topology

__version__ = "0.1.0"

__all__ = [
    "CPGTStrategy",
    "QSGD",
    "CorrelatedNoiseStrategy",
    "DP2SGDStrategy",
    "DPCSGPStrategy",
    "DynD2PStrategy",
    "PrivSGPStrategy",
    "PrivSGPVRStrategy",
    "PrivacyBudgetCallback",
    "PrivacyConfigError",
    "DecentralizedPushSumStrategy",
    "DecentralizedSGDStrategy",
    "DecentralizedStrategy",
    "DivergenceError",
    "Identity",
    "NodeMismatchError",
    "NonFiniteStepError",
    "PeerFailureError",
    "RandK",
    "Sign",
    "TopK",
    "Topology",
    "TopologyError",
    "build_topology",
]
