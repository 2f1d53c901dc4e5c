"""The worker pool: worker specs, health, capacity read from the engines, tokenizer parity probes,
and discovery (static, file, Kubernetes, etcd)."""
