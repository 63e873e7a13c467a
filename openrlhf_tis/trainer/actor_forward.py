"""The seam both π_old substitutions need (trainer/bypass.py: μ as π_old; trainer/moe_experience.py: the engines'
experts replayed): upstream's `make_experience` dispatches one `forward` per model group, every group with the same
keyword arguments and no per-sample hook, so a fork class that changes the actor group's forward must remember the
samples of the call in flight.
"""

from __future__ import annotations

from collections.abc import Sequence


class ActorForwardSeam:
    """Mixin placed before upstream's `RemoteExperienceMaker` in a fork class's bases: while `make_experience` runs,
    the actor group's forward goes through `_actor_forward(samples, sync_condition, **kwargs)`."""

    _samples_in_flight: Sequence | None = None

    def make_experience(self, samples_list):
        self._samples_in_flight = samples_list
        try:
            return super().make_experience(samples_list)
        finally:
            self._samples_in_flight = None

    def _dispatch_forward(self, group, sync_condition, **kwargs):
        samples = self._samples_in_flight
        if group is self.actor_model_group and samples is not None:
            return self._actor_forward(samples, sync_condition, **kwargs)
        return super()._dispatch_forward(group, sync_condition, **kwargs)

    def _actor_forward(self, samples: Sequence, sync_condition, **kwargs):
        """Upstream's dispatch of the actor group's forward; a fork class overrides it."""
        return super()._dispatch_forward(self.actor_model_group, sync_condition, **kwargs)
