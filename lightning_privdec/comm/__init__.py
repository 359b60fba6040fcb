"""How bytes move between neighbours: point-to-point exchanges over torch.distributed, and a loopback simulator."""

from lightning_privdec.comm.base import Exchange, NonFiniteMessageError, PendingRound, TensorSpec, TrafficCounter
from lightning_privdec.comm.distributed import TorchDistributedExchange, message_nbytes, pack, unpack
from lightning_privdec.comm.loopback import LoopbackExchange, LoopbackNetwork

__all__ = [
    "Exchange",
    "LoopbackExchange",
    "LoopbackNetwork",
    "NonFiniteMessageError",
    "PendingRound",
    "TensorSpec",
    "TorchDistributedExchange",
    "TrafficCounter",
    "message_nbytes",
    "pack",
    "unpack",
]
