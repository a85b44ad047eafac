"""The weight sync's error, in a module of its own so `weight_sync`, its transports and `rejoin` share it without
importing each other."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight sync failed; the server may hold partial weights and stay paused: restart it."""
