"""openrlhf_tis: OpenRLHF extended to measure and correct the rollout-training mismatch (see README.md)."""
