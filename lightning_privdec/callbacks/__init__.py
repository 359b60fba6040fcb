"""What the user watches: privacy budget, consensus error, communication cost, and network-average evaluation."""

from lightning_privdec.callbacks.communication import CommunicationCostCallback
from lightning_privdec.callbacks.consensus import ConsensusErrorCallback
from lightning_privdec.callbacks.network_average import NetworkAverageEvaluation
from lightning_privdec.callbacks.privacy_budget import PrivacyBudgetCallback

__all__ = ["CommunicationCostCallback", "ConsensusErrorCallback", "NetworkAverageEvaluation", "PrivacyBudgetCallback"]
