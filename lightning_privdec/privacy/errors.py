"""The single exception type raised for invalid privacy configurations."""

from __future__ import annotations

__all__ = ["PrivacyConfigError"]


class PrivacyConfigError(ValueError):
    """An invalid differential-privacy configuration (parameters, model, data loader or budget).

    Every message says what is wrong and how to fix it, so it can be shown to the user as-is before training
    starts.
    """
