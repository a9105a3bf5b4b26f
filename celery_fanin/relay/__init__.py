"""The relay sidecar: publishes what the store holds (successors from the outbox, children no producer published)
and runs the periodic duties (lost children, deadlines, reconciliation); also the Prometheus metrics it serves."""

from .loop import Relay, RelayStats

__all__ = ["Relay", "RelayStats"]
