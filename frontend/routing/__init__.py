"""The routing decision: the prompt's tokens and hashes, the per-model state, eligibility and busy
thresholds, the router queue, overlaps (embedded or remote), cost and choice, and what follows from
a decision (routing record, decision log, speculative prefill, disaggregated prefill)."""
