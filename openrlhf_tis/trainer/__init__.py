"""The fork's PPO controller and actor (subclasses of upstream's), their helpers, and the weight-sync check.

ppo_trainer (controller) · step_part (the controller's jobs, one part each) · ppo_actor (actor) · policy_loss
(where the correction meets the loss) · token_dumps (dump plan and collector) · bypass (controller-side bypass
experience maker) · rewards · staleness · sync_check · eval_samples. Each reads the run as the driver resolved it
(openrlhf_tis.run_spec).
"""
