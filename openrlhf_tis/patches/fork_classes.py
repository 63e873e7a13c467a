"""Wire the fork's trainer classes into upstream's `train()` (driver only).

upstream's `openrlhf.cli.train_ppo_ray.train` picks its controller with
`from openrlhf.trainer.ppo_trainer import PPOTrainer` inside the function body and offers no other
seam, so the module attribute is pointed at the fork's subclass before `train()` runs. The subclass
is a Ray actor class in an importable module, so Ray workers load it by reference.

Async training's driver class likewise (`ppo_trainer_async.PPOTrainerAsync`); it runs in a Ray worker of
its own and wires the fork's trainer and generator there (trainer/ppo_trainer.py's `_TisPPOTrainerAsync`).

The policy actor likewise: `openrlhf.cli.train_ppo_ray` binds `PolicyModelActor` with a module-level
`from openrlhf.trainer.ray.ppo_actor import PolicyModelActor`; the fork runs that module (runpy) after
this patch, so pointing the attribute at the fork's actor (the rollout correction as policy loss,
openrlhf_tis/trainer/ppo_actor.py) reaches `train()`. The engine actor class is the fork's too
(patches/rollout_engine.py: use_fork_engine_actor).
"""

from __future__ import annotations

from openrlhf_tis.upstream_guards import replace, require_version

NAME = "fork_classes"


def apply() -> bool:
    require_version("openrlhf", "==0.11.2", patch=NAME)
    import openrlhf.trainer.ppo_trainer as upstream

    from openrlhf_tis.trainer.ppo_trainer import TisPPOTrainer, check_sync_hooks_reached

    check_sync_hooks_reached()  # the controllers' class-order trick (InsideSyncHooks), before any is used
    replace(upstream, "PPOTrainer", TisPPOTrainer, patch=NAME)

    # Async training (--train.async_enable): `train()` imports PPOTrainerAsync from its module inside the
    # function body; the fork's builds its two actors from the fork's classes (`_TisPPOTrainerAsync`).
    import openrlhf.trainer.ppo_trainer_async as upstream_async

    from openrlhf_tis.trainer.ppo_trainer import TisPPOTrainerAsync

    replace(upstream_async, "PPOTrainerAsync", TisPPOTrainerAsync, patch=NAME)

    import openrlhf.trainer.ray.ppo_actor as upstream_actor

    from openrlhf_tis.trainer.ppo_actor import PolicyModelActor

    replace(upstream_actor, "PolicyModelActor", PolicyModelActor, patch=NAME)

    from .rollout_engine import use_fork_engine_actor

    use_fork_engine_actor()
    return True
