"""ray_actor_class unwraps a real `@ray.remote` actor class (decorating needs no running Ray)."""

from __future__ import annotations

import pytest
import ray

from openrlhf_tis.ray_classes import ray_actor_class


class Plain:
    def __init__(self, x: int):
        self.x = x

    def get(self) -> int:
        return self.x


Remote = ray.remote(num_cpus=1)(Plain)


def test_unwraps_the_plain_class_for_subclassing():
    assert ray_actor_class(Remote) is Plain

    class Sub(ray_actor_class(Remote)):
        def get(self) -> int:
            return super().get() + 1

    assert Sub(2).get() == 3
    rewrapped = ray.remote(num_cpus=1)(Sub)
    assert ray_actor_class(rewrapped) is Sub


def test_ray_refuses_subclassing_the_remote_class():
    """Why the helper exists: the decorated class cannot be a base."""
    with pytest.raises(TypeError):
        class Sub(Remote):
            pass
