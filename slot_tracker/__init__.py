"""kvroute slot tracker: active-request accounting per (model, tenant, worker, DP rank).

- ``slot_tracker.core``: ``SlotRegistry`` / ``SlotTracker`` (no I/O; embedded by the frontend).
- ``slot_tracker.service``: the HTTP routes (``tracker_routes``), ``build_app`` and the hot
  ``POST /potential_loads`` handler (``hot_routes``, served by ``kvroute_common.fast_http``).
- ``slot_tracker.replica_sync``: ``ReplicaSync``, lifecycle events between replicas over ZMQ.
- ``python -m slot_tracker``: the standalone service.
"""
