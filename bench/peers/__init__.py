"""Peer systems run on the same job as Conveyor, each in a process of its own (docs/performance/peers.md)."""
