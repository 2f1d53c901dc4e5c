"""Routing core: block hashing, cost and selection, configuration, queue policies. No I/O."""
