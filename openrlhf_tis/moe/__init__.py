"""Mixture-of-experts routing: which models routing replay covers, the replay in the trainer's MoE blocks, and
the routing-mismatch metrics.

coverage (which config.json a replay can serve; no torch, for the checks before Ray starts) · routing_replay (the
trainer's routers use replayed expert indices; torch and transformers) · routing_metrics (agreement between two
routings and the k3 split by it; numpy). docs/moe.md says what is built and what is not yet.
"""
