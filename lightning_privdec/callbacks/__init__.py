"""What the user watches: privacy budget (and, later, consensus error and communication cost)."""

from lightning_privdec.callbacks.privacy_budget import PrivacyBudgetCallback

__all__ = ["PrivacyBudgetCallback"]
