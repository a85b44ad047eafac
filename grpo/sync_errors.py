"""The weight-sync error, below both modules that raise it: grpo/weight_sync.py (a failed transfer or pause) and
grpo/rejoin.py (the last server lost and none came back), and the transports (grpo/sync_*.py), so none imports
the others for it."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight sync failed; the server may hold partial weights and stay paused: restart it."""
