"""The garbage-collection policy of the long-running processes (frontend, indexer): full
collections made rare.

Why: an index (the standalone indexer's, or the one a frontend embeds) is a large heap of
long-lived containers (runs, their hash lists and holder sets, the per-worker lookup dicts).
CPython runs a full collection at every 25 % of heap growth once ten generation-1 collections
have passed, and each one walks the whole heap: on 4-worker ingest that was about a third of the
indexer's CPU (docs/bench/indexer.md), and in a frontend ingesting a 400k-token prompt's KV
events one full collection held the event loop for 44 ms. With 1000 instead of 10, a full
collection comes at most every ~7 M container allocations (700 x 10 x 1000); short-lived cycles
are still collected by generations 0 and 1. Objects alive at start-up (modules, classes) are
frozen out of every collection.
"""

from __future__ import annotations

import gc

GC_FULL_AFTER = 1000
"""Generation-1 collections between two full collections (CPython's default is 10)."""


def tune_gc() -> None:
    """Collect once, freeze what is alive now, and make later full collections rare."""
    gc.collect()
    gc.freeze()
    threshold0, threshold1, _ = gc.get_threshold()
    gc.set_threshold(threshold0, threshold1, GC_FULL_AFTER)
