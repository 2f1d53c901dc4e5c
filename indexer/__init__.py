"""kvroute indexer: which worker (and DP rank) holds which prompt blocks, learned from KV events.

Modules (one concept each):
  wire       vLLM 0.33 KV-event wire format (encode exactly; decode map/array forms)
  core       KvIndex for one (model, tenant): device radix tree + lower tiers, dump/restore (no I/O)
  normalize  engine events -> index operations (medium table, filters, local hashes from tokens)
  listener   asyncio ZMQ SUB listener per (instance, dp_rank), sequence tracking and gap replay
  registry   IndexerRegistry: partitions + listeners (shared by the service and the frontend)
  service    HTTP routes (Starlette), the /query answer, the hot query handlers (``hot_routes``)
  app        ``python -m indexer``: CLI, start-up (workers, P2P recovery, gate), serving
             (uvicorn via kvroute_common.fast_http, shared with the slot tracker)
"""
