"""Each paper's Algorithm 1 as one node algorithm on flat tensors, with the exchange passed in (no Lightning).

One file per paper: :mod:`.sgp`, :mod:`.dp_csgp` (with PrivSGP and DP^2-SGD), :mod:`.privsgp_vr`, :mod:`.cpgt`,
:mod:`.dyn_d2p`, :mod:`.decor`; beneath them the node lifecycle (:mod:`.base`), the shared mixing (:mod:`.mixing`),
the one node step the strategies and the simulator run (:mod:`.node`) and a loopback runner (:mod:`.simulation`).
"""

from lightning_privdec.algorithms.base import NodeAlgorithm, PrivateNodeAlgorithm
from lightning_privdec.algorithms.cpgt import CPGTGossip, CPGTNode
from lightning_privdec.algorithms.decor import DecorNode
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.algorithms.dyn_d2p import DynD2PNode
from lightning_privdec.algorithms.mixing import PushSumGossip, RoundPlan, message_key, plan_round
from lightning_privdec.algorithms.privsgp_vr import PrivSGPVRNode
from lightning_privdec.algorithms.sgp import SGPNode
from lightning_privdec.algorithms.simulation import train_network, train_node

__all__ = [
    "CPGTGossip", "CPGTNode", "DPCSGPNode", "DecorNode", "DynD2PNode", "NodeAlgorithm", "PrivSGPVRNode",
    "PrivateNodeAlgorithm", "PushSumGossip", "RoundPlan", "SGPNode", "message_key", "plan_round", "train_network",
    "train_node",
]
