"""Paper update rules as pure tensor state machines on flat vectors, with the exchange passed in (no Lightning)."""

from lightning_privdec.algorithms.mixing import PushSumGossip, RoundPlan, message_key, plan_round
from lightning_privdec.algorithms.cpgt import CPGTGossip

__all__ = ["CPGTGossip", "PushSumGossip", "RoundPlan", "message_key", "plan_round"]
