"""The single exception type raised by :mod:`lightning_privdec.topology`."""

from __future__ import annotations

__all__ = ["TopologyError"]


class TopologyError(ValueError):
    """An invalid topology or mixing-weight configuration.

    Every message says what is wrong and how to fix it, so it can be shown to
    the user as-is before training starts.
    """
