"""Routing core without I/O: configuration (flags + ``DYN_*`` environment), cost and selection, the latency
mode's TTFT estimate, queue ordering, the session table. Block hashing is a wire contract in
``kvroute_common.hashing``."""
