"""Real engines (vLLM's CPU build) on loopback for the tests and benchmarks: a tiny model that uses
kvroute's tokenizer, and engine processes started and stopped like any other server."""
