"""Observability: Prometheus metrics, per-request lifecycle metrics, the hit-rate decomposition,
the hash-parity alarm and the event-loop lag."""
