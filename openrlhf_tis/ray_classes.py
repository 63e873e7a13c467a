"""Ray actor classes, unwrapped for subclassing.

Upstream decorates its actors with `@ray.remote` (the PPO controller, the policy actor, the vLLM engine
actor); Ray forbids subclassing such an actor class, so the fork subclasses the plain class it wraps
and decorates its subclass again. Imports nothing from the package: any layer may use it.
"""

from __future__ import annotations


def ray_actor_class(remote_cls) -> type:
    """The plain Python class a `@ray.remote` actor class wraps (a `ray.actor.ActorClass`)."""
    return remote_cls.__ray_metadata__.modified_class.__ray_actor_class__
