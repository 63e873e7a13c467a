"""Build async training's two actors from the fork's classes, in the process that builds them.

upstream's `PPOTrainerAsync.__init__` creates its trainer and sample generator from the module globals
`TrainingActor` and `GenerateSamplesActor` of `openrlhf.trainer.ppo_trainer_async`, with no seam. It runs in
its own Ray worker, not in the driver where `fork_classes` applies, so the fork's `PPOTrainerAsync` applies
this patch there, just before upstream's `__init__`. The classes are passed in (this module imports nothing
from the fork's trainer, which imports it).
"""

from __future__ import annotations

from ._guard import replace, require_version

NAME = "async_actors"


def apply(training_actor, generator_actor) -> bool:
    require_version("openrlhf", "==0.11.2", patch=NAME)
    import openrlhf.trainer.ppo_trainer_async as upstream

    replace(upstream, "TrainingActor", training_actor, patch=NAME)
    replace(upstream, "GenerateSamplesActor", generator_actor, patch=NAME)
    return True
