"""Paper update rules as pure tensor state machines on flat vectors, with the exchange passed in (no Lightning)."""

from lightning_privdec.algorithms.push_sum import PushSumGossip, RoundPlan, message_key, plan_round

__all__ = ["PushSumGossip", "RoundPlan", "message_key", "plan_round"]
