"""train.ipynb's parameters as one typed object, and everything derived from them.

Each field names the training CLI flag it becomes, so the notebook's parameters cell (pipeline/notebooks.py), the
checks of a notebook, a sweep grid and the main job (params.py), the training command line (`argv`) and the
held-out evaluation's settings (`heldout_settings`) all come from this one declaration. The four fields without a
flag act in the notebook's job: steps bounds the prompt file, eval_kept scores the saved model after the run,
extra_args are flags already, refresh_seconds paces the live curves.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from openrlhf_tis.cli.cluster_device import ClusterResources, decide_device, read_cluster, requested_device
from openrlhf_tis.cli.fork_flags import FLAGS, correction_option_problem
from openrlhf_tis.correction.config import FLAG_PREFIX, PRESETS
from openrlhf_tis.cpu_features import default_train_dtype
from openrlhf_tis.moe.coverage import REPLAY_FLAG
from openrlhf_tis.params import ParamObject, param, positive
from openrlhf_tis.pipeline.kept_eval import KEPT_MODEL_DIR
from openrlhf_tis.rollout.precision import PRECISION_FLAG, WEIGHT_BITS_FLAG
from openrlhf_tis.runs.kept_score import HeldoutSettings
from openrlhf_tis.trainer.sync_cadence import SYNC_EVERY_FLAG
from openrlhf_tis.trainer.untrained_scores import FLAG as UNTRAINED_CACHE_FLAG

DEMO_REWARD = Path(str(resources.files("openrlhf_tis") / "demo" / "dense_reward.py"))
EVAL_TEMPERATURE = 1.0  # held-out samples are drawn as in training, so pass1 is the training reward's held-out twin


def _existing_file_or_empty(value: str) -> str | None:
    return None if not value or Path(value).expanduser().is_file() else f"no such file: {value}"


MODEL_NAMES = ("tiny", "default", "upcycled")  # the models pipeline/train.py resolve_model builds


def _model(value: str) -> str | None:
    if value in MODEL_NAMES or (Path(value).expanduser() / "config.json").is_file():
        return None
    return "must be 'tiny', 'default', 'upcycled' or a model directory holding config.json"


def _str_list(value: list) -> str | None:
    return None if all(isinstance(v, str) for v in value) else "must be a list of strings"


def _options(value: dict) -> str | None:
    """The first entry the CLI would refuse as `--algo.correction.<name> <value>`, said as it would."""
    return next((why for name, item in value.items() if (why := correction_option_problem(name, item))), None)


def _not_negative(value: int) -> str | None:
    return None if value >= 0 else "must be >= 0"


def _eval_every(value: int) -> str | None:
    return None if value >= -1 else "must be >= 0, or -1 (no in-run evaluation)"


def micro_batch(batch: int, largest: int = 8) -> int:
    """The largest micro batch up to `largest` that divides `batch` (DeepSpeed needs whole micro batches)."""
    return max(d for d in range(1, min(batch, largest) + 1) if batch % d == 0)


@dataclass(frozen=True)
class TrainParams(ParamObject):
    """One training job's parameters; the field order is the order of the parameters cell and of the flags."""

    model: str = param("tiny", "'tiny' (random 2-layer, seconds per step), 'default' (embedded SmolLM2-135M-Instruct), "
                       "'upcycled' (it upcycled into a 4-expert top-2 Mixtral, the MoE demo) or a model directory",
                       (str,), check=_model, flag="--actor.model_name_or_path")
    prompts: str = param("", "prompt JSONL with input/label keys; '' writes the demo task's training questions", (str,),
                         check=_existing_file_or_empty, flag="--data.prompt_dataset")
    reward: str = param("", "reward script defining reward_func; '' uses the demo task's reward plus its dense digit "
                        "term", (str,), check=_existing_file_or_empty, flag="--reward.remote_url")
    correction: str = param("tis", "a correction preset (--algo.correction.preset)", (str,), tuple(PRESETS),
                            flag=FLAG_PREFIX + "preset")
    correction_options: dict = param({}, "single correction fields over the preset, e.g. {'upper': 3}", (dict,),
                                     check=_options, flag=FLAG_PREFIX)
    eval_prompts: str = param("", "held-out prompt JSONL (same keys), scored with the training reward before the "
                              "first step and every eval_every steps; '' skips evaluation", (str,),
                              check=_existing_file_or_empty, flag="--eval.dataset")
    eval_samples: int = param(1, "responses sampled per held-out prompt (at temperature 1, as in training)", (int,),
                              check=positive, flag="--eval.n_samples_per_prompt")
    eval_kept: bool = param(True, "with eval_prompts: after training, also score the weights the run keeps (its saved "
                            "final model, in the trainer's dtype, unquantized) and the base model on the same "
                            "questions and samples (<run_dir>/heldout_kept.json); the in-run score goes through the "
                            "rollout engine", (bool,))
    eval_every: int = param(0, "score the held-out set every N steps (0: before the first step and after the last; "
                            "-1: never in the run, only the kept policy after it)", (int,), check=_eval_every,
                            flag="--eval.steps")
    rollout_precision: str = FLAGS[PRECISION_FLAG].param("vLLM rollout precision")
    int8_weight_bits: str = FLAGS[WEIGHT_BITS_FLAG].param(
        "int8 rollouts' weight grid (--vllm.int8_weight_bits): auto (8 bits, 7 where the CPU's int8 GEMM saturates "
        "8-bit weights) or a bit count; only with rollout_precision int8")
    train_dtype: str = param("auto", "trainer precision (--ds.param_dtype); auto: bf16 on CUDA or CPUs with native "
                             "bf16, fp32 where the CPU emulates bf16", (str,), ("auto", "bf16", "fp32"),
                             flag="--ds.param_dtype")
    steps: int = param(2, "training steps (one rollout batch each)", (int,), check=positive)
    prompts_per_step: int = param(4, "prompts per rollout batch", (int,), check=positive, flag="--rollout.batch_size")
    samples_per_prompt: int = param(2, "responses per prompt (group estimators need 2 or more)", (int,),
                                    check=positive, flag="--rollout.n_samples_per_prompt")
    max_new_tokens: int = param(24, "longest response in tokens", (int,), check=positive,
                                flag="--rollout.max_new_tokens")
    lr: float = param(1e-3, "actor learning rate (tiny random models need ~1e-3, real ones ~1e-6..1e-5)", (float,),
                      check=positive, flag="--actor.adam.lr")
    seed: int = param(42, "training seed", (int,), flag="--train.seed")
    async_queue: int = param(0, "async training: rollout batches the generator may run ahead of the trainer "
                             "(--train.async_enable --train.async_queue_size N); 0 trains synchronously", (int,),
                             check=_not_negative, flag="--train.async_queue_size")
    sync_every: int = FLAGS[SYNC_EVERY_FLAG].param(
        "send the weights to the engines after every Nth step only: step s+1's samples are s mod N versions behind "
        "(a fixed staleness dose; 1: every step)", check=positive)
    routing_replay: str = FLAGS[REPLAY_FLAG].param(
        "mixture-of-experts routing replay: r3 replays the experts the engines chose in the trainer's forwards (an "
        "MoE model only, e.g. 'upcycled'); measure: the trainer routes itself and moe/* compares its routing with the "
        "engines'; off: the trainer routes every token itself, unmeasured")
    token_dump_every: int = FLAGS["--logger.token_dump_steps"].param("dump per-token records every N steps (0: never)",
                                                                     default=1, check=_not_negative)
    run_dir: str = param("runs/notebook", "the run directory (created; a finished one is refused by the CLI)", (str,),
                         check=lambda v: None if v else "must not be empty", flag="--logger.run_dir")
    untrained_cache: str = FLAGS[UNTRAINED_CACHE_FLAG].param(
        "a folder where runs share the untrained policy's held-out scores (computed once per model, seed, task and "
        "engine; a sweep sets its OUT/untrained); '' evaluates every run", default="")
    extra_args: list = param([], "more training CLI flags, e.g. ['--vllm.fp32_lm_head']; they win over the above",
                             (list,), check=_str_list)
    refresh_seconds: float = param(2.0, "how often the live figure polls metrics.jsonl", (float, int), check=positive)

    def max_len(self) -> int:
        """Prompt + response budget (--data.max_len): the demo prompts fit 128 tokens."""
        return 128 + self.max_new_tokens

    def reward_file(self) -> Path:
        return Path(self.reward).expanduser().resolve() if self.reward else DEMO_REWARD

    def eval_file(self) -> Path | None:
        """The held-out prompt file, resolved; None when the run is not evaluated."""
        return Path(self.eval_prompts).expanduser().resolve() if self.eval_prompts else None

    def run_device(self, cluster: ClusterResources | None = None) -> str:
        """cpu or cuda: what the training CLI will decide for this job (extra_args' --cluster.device, else auto) on
        `cluster`, by default the one the CLI will read (RAY_ADDRESS's, else this machine's); UsageError when they
        disagree. The same decision as the CLI's (cli/cluster_device.py), not this process's `torch.cuda`."""
        return decide_device(requested_device(self.extra_args), read_cluster() if cluster is None else cluster)

    def trainer_dtype(self, device: str | None = None) -> str:
        """The trainer's dtype (--ds.param_dtype): what the run's saved model holds. `device`: the run's (cpu or
        cuda), decided by run_device when None and needed."""
        if self.train_dtype != "auto":
            return self.train_dtype
        return default_train_dtype(device or self.run_device())

    def heldout_settings(self, device: str | None = None) -> HeldoutSettings:
        """How the kept policy and the base model are scored after training: as the run samples its held-out set."""
        return HeldoutSettings(dtype=self.trainer_dtype(device), n_samples=self.eval_samples, seed=self.seed,
                               temperature=EVAL_TEMPERATURE, max_new_tokens=self.max_new_tokens,
                               max_len=self.max_len())

    def _as_flags(self, model_dir: Path, prompts: Path, run_dir: Path, device: str | None) -> dict[str, Any]:
        """The values the flags take where they are not the parameter itself: files resolved, None where the flag
        is left out."""
        evaluated = self.eval_file() is not None  # sampled as in training: held-out pass@1 is the reward's twin
        return {
            "model": model_dir, "prompts": prompts, "reward": self.reward_file(),
            "train_dtype": self.trainer_dtype(device), "run_dir": run_dir, "eval_prompts": self.eval_file(),
            "eval_samples": self.eval_samples if evaluated else None,
            "eval_every": self.eval_every or self.steps if evaluated else -1,
            # the CLI refuses an explicit grid for other precisions, naming the flag
            "int8_weight_bits": None if self.int8_weight_bits == "auto" else self.int8_weight_bits,
            "async_queue": self.async_queue or None,
            "sync_every": self.sync_every if self.sync_every > 1 else None,  # upstream's sync after every step
            "routing_replay": None if self.routing_replay == "off" else self.routing_replay,  # a dense run's lines kept
            "untrained_cache": str(Path(self.untrained_cache).expanduser().resolve()) if self.untrained_cache else None,
        }

    def argv(self, model_dir: Path, prompts: Path, run_dir: Path, device: str | None = None) -> list[str]:
        """The training command line: each field's flag, then what the notebook's job fixes or derives from several
        fields, then extra_args (last, so they win). `model_dir`, `prompts`, `run_dir`: the resolved model
        directory, the run's prompt file and run directory (pipeline/train.py); `device`: the run's (run_device)."""
        group = self.samples_per_prompt
        batch = self.prompts_per_step * group
        micro = str(micro_batch(batch))
        argv = [
            sys.executable, "-m", "openrlhf_tis.cli.train_ppo_ray",
            *self.flag_argv(**self._as_flags(model_dir, prompts, run_dir, device)),
            "--data.input_key", "input", "--data.label_key", "label",
            "--data.apply_chat_template", "--data.max_len", str(self.max_len()), "--vllm.num_engines", "1",
            "--algo.advantage.estimator", "group_norm" if group > 1 else "reinforce", "--algo.kl.init_coef", "0",
            "--rollout.micro_batch_size", micro, "--train.batch_size", str(batch), "--train.micro_batch_size", micro,
            "--train.num_episodes", "1", "--train.max_epochs", "1", "--ds.zero_stage", "2",
            "--actor.lr_warmup_ratio", "0",
            # No DeepSpeed checkpoints: upstream still saves a "best" one (2.1 GB for SmolLM2 with Adam) whenever
            # the engine's held-out score improves unless its metric key is "none"; the kept weights go to
            # output_dir.
            "--ckpt.path", str(run_dir / "ckpt"), "--ckpt.save_steps", "-1", "--ckpt.best_metric_key", "none",
            "--ckpt.output_dir", str(run_dir / KEPT_MODEL_DIR),
            "--logger.logging_steps", "1",
        ]
        if self.eval_prompts:
            argv += ["--eval.temperature", str(EVAL_TEMPERATURE)]
        if self.async_queue:
            argv += ["--train.async_enable"]
        return argv + list(self.extra_args)
