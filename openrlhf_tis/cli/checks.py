"""Argument checks that must end a run before Ray starts, each naming the flag at fault; they only check.

What a run's flags decide (upstream's GPU defaults a CPU run replaces, the correction, every `auto`) is decided in
cli/resolve.py, which runs these checks first; the checks that need a decision are given the run spec.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from openrlhf_tis.cli.fork_flags import FORK_FLAGS
from openrlhf_tis.errors import UsageError
from openrlhf_tis.model_files import check_model_path, read_model_config
from openrlhf_tis.moe.coverage import ENGINE_ROUTING_MODES, REPLAY_FLAG, engine_refusal, replay_refusal
from openrlhf_tis.prompt_files import PromptFileError, item_sources, prompt_problem, read_records, token_counts
from openrlhf_tis.rollout.reward_calls import TIMEOUT_FLAG, check_timeout
from openrlhf_tis.run_spec import RunSpec
from openrlhf_tis.trainer.untrained_scores import FLAG as UNTRAINED_CACHE_FLAG

_UNSET = object()


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations the user set on the command line (even to their default value).

    argparse leaves alone any attribute already present on the namespace it is given, so parsing into
    a namespace pre-filled with a sentinel leaves the sentinel exactly where nothing was passed.
    """
    dests = {a.dest for a in parser._actions if a.dest is not argparse.SUPPRESS and a.dest != "help"}
    probe = argparse.Namespace(**{d: _UNSET for d in dests})
    parsed, _ = parser.parse_known_args(argv, namespace=probe)
    return {d for d in dests if getattr(parsed, d) is not _UNSET}


def check_reward_script(flag: str, url: str | None) -> None:
    """A local reward script must exist and define reward_func (checked without running it)."""
    if not url or not url.endswith(".py"):
        return
    for path in url.split(","):
        if not os.path.isfile(path):
            raise UsageError(flag, f"reward script {path!r} does not exist")
        try:
            tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
        except SyntaxError as err:
            raise UsageError(flag, f"reward script {path!r} does not parse: {err}") from err
        if not any(isinstance(n, ast.FunctionDef) and n.name == "reward_func" for n in tree.body):
            raise UsageError(flag, f"reward script {path!r} defines no reward_func(queries, prompts, labels)")


@dataclass(frozen=True)
class DatasetRead:
    """What check_dataset read: the first record, the number of records (None unless every item of the spec was
    read here) and (where, --data.input_key value) of each row upstream can reach (the first --data.max_samples
    of each source: upstream takes no more from any)."""
    first: dict[str, Any] | None = None
    records: int | None = None
    prompts: list[tuple[str, Any]] = field(default_factory=list)


def check_dataset(flag: str, spec: str | None, keys: dict[str, str | None], *, required: bool = True,
                  split: str = "train", reach: int = 0, modelscope: bool = False) -> DatasetRead:
    """Dataset files named on the command line must exist; local JSON(L), Parquet and CSV ones are read whole, and
    so are local directories, resolved as upstream resolves them (prompt_files.item_sources: one upstream cannot
    load is refused here); `split` is the split upstream selects (--data.prompt_split / --eval.split).

    `keys` maps each key flag (`--data.input_key`, ...) to its value; every record must have the keys
    that are set. Hub names are left to upstream. The prompts of the first `reach` rows of each source come back
    for the row checks (check_prompt_rows).
    """
    if not spec:
        if required:
            raise UsageError(flag, "is required")
        return DatasetRead()
    for item in spec.split(","):
        path = item.split("@")[0].strip()
        looks_local = path.startswith((".", "/", "~")) or os.path.splitext(path)[1] in (
            ".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt",
        )
        if looks_local and not os.path.exists(os.path.expanduser(path)):
            raise UsageError(flag, f"dataset {path!r} does not exist")
    key_flags = {key: key_flag for key_flag, key in keys.items() if key}
    first, count, prompts, every_item_read = None, 0, [], True
    try:
        for item in spec.split(","):
            sources = item_sources(item, split, modelscope=modelscope)
            every_item_read &= sources is not None
            for name, records in sources or []:
                found = read_records(name, records, list(key_flags), keys.get("--data.input_key"), reach)
                first = first if first is not None else found.first
                count += found.records
                prompts += found.kept
    except PromptFileError as err:
        raise UsageError(key_flags.get(err.key, flag), str(err)) from None
    return DatasetRead(first, count if every_item_read else None, prompts)


def check_prompt_rows(args: argparse.Namespace, prompts: list[tuple[str, Any]]) -> None:
    """Every reachable row must give upstream a prompt: not empty, of a type its PromptDataset formats
    (prompt_files.prompt_problem), and, with the chat template, one the template renders. Upstream finds an empty
    prompt only when vLLM refuses it, at the first step that samples it, naming no row."""
    chat = getattr(args, "data.apply_chat_template")
    template = _input_template(args)
    key = getattr(args, "data.input_key")
    for where, value in prompts:
        if problem := prompt_problem(value, chat, template):
            raise UsageError("--data.input_key", f"{where}: {key!r} {problem}")


def _input_template(args: argparse.Namespace) -> str | None:
    """--data.input_template as upstream's __main__ leaves it (dropped, with a warning there, without `{}`)."""
    template = getattr(args, "data.input_template")
    return template if template and "{}" in template else None


def check_prompt_lengths(args: argparse.Namespace, prompts: list[tuple[str, Any]]) -> None:
    """No reachable prompt may reach --data.max_len tokens, counted as the rollout counts them (formatted by
    upstream's preprocess_data, with the chat template when set, tokenized without special tokens by the actor's
    tokenizer; the model's weights are not loaded).

    Upstream's rollout (SingleTurnAgentExecutor.execute) gives prompt and response --data.max_len tokens together
    and cuts from its start a prompt that leaves the response (--rollout.max_new_tokens, else at least one token)
    no room: one of --data.max_len tokens or more keeps at most its last max_len - 1 tokens and gets a response
    of one token (or --rollout.max_new_tokens with fewer kept), no training sample, and a reward script that looks
    for the prompt in the query does not find it: refused. A shorter prompt cut only to leave the room of
    --rollout.max_new_tokens keeps its whole response budget, as upstream intends: warned. A --rollout.max_new_tokens
    above --data.max_len makes upstream drop the start of every prompt (and send vLLM an empty one when that is
    all of it): refused. Skipped for a vision-language model, whose prompts are counted with their images.
    """
    if not prompts:
        return
    max_len, max_new = getattr(args, "data.max_len"), getattr(args, "rollout.max_new_tokens")
    if max_new is not None and max_new > max_len:
        raise UsageError("--rollout.max_new_tokens", f"{max_new} is more than --data.max_len {max_len}, which prompt "
                         f"and response share: upstream would drop the first {max_new - max_len} tokens of every "
                         "prompt (and vLLM refuses one left empty)")
    tokenizer = _actor_tokenizer(args)
    if hasattr(tokenizer, "image_processor"):
        return
    texts = [_formatted(args, tokenizer, where, value) for where, value in prompts]
    counts = token_counts(texts, tokenizer)
    how = "with the chat template" if getattr(args, "data.apply_chat_template") else "as formatted"
    kept = max_len - (max_new or 1)
    for (where, _), count in zip(prompts, counts, strict=True):
        if count >= max_len:
            raise UsageError("--data.max_len", f"{where}: the prompt is {count} tokens ({how}), not under "
                             f"--data.max_len {max_len} (prompt + response): no room for a response; upstream "
                             f"would keep only its last {kept} tokens and generate {max_new or 'one'} (raise "
                             "--data.max_len or shorten the prompt)")
    if max_new is not None and max_new < max_len:
        _warn_cut_prompts(prompts, counts, kept, max_new)


def _warn_cut_prompts(prompts: list[tuple[str, Any]], counts: list[int], room: int, max_new: int) -> None:
    """One warning for the prompts upstream cuts from the start to leave --rollout.max_new_tokens room."""
    cut = [(where, count) for (where, _), count in zip(prompts, counts, strict=True) if count > room]
    if cut:
        where, count = cut[0]
        print(f"[openrlhf_tis] warning: --data.max_len: {len(cut)} prompt(s) longer than the {room} tokens "
              f"--rollout.max_new_tokens {max_new} leaves them (first: {where}, {count} tokens); upstream cuts their "
              "first tokens to fit, so the model never sees their start", file=sys.stderr)


def _actor_tokenizer(args: argparse.Namespace) -> Any:
    """The tokenizer upstream's rollout uses (get_tokenizer on --actor.model_name_or_path), without the model."""
    from openrlhf.utils.utils import get_tokenizer

    model = getattr(args, "actor.model_name_or_path")
    try:
        return get_tokenizer(model, None, use_fast=not getattr(args, "data.disable_fast_tokenizer"))
    except Exception as err:  # transformers raises many types for a missing or broken tokenizer
        raise UsageError("--actor.model_name_or_path", f"cannot load the tokenizer of {model}: "
                         f"{type(err).__name__}: {err}") from None


def _formatted(args: argparse.Namespace, tokenizer: Any, where: str, value: Any) -> str:
    """One row's prompt text exactly as upstream's PromptDataset builds it; a chat template that fails on the row
    is refused naming it."""
    from openrlhf.datasets.prompts_dataset import preprocess_data

    key = getattr(args, "data.input_key")
    chat = tokenizer.apply_chat_template if getattr(args, "data.apply_chat_template") else None
    try:
        prompt, _ = preprocess_data({key: value}, _input_template(args), key, None, chat)
    except Exception as err:  # jinja's errors, a template's own raise_exception, str.format's, ...
        what = "the chat template of --actor.model_name_or_path" if chat else "--data.input_template"
        raise UsageError("--data.input_key", f"{where}: {what} fails on {key!r}: {type(err).__name__}: {err}") from None
    return prompt


def planned_steps(args: argparse.Namespace, prompts: int | None) -> int | None:
    """The steps upstream's fit() will log for `prompts` training prompts: one per --rollout.batch_size prompts
    (a last partial batch included) per episode; None when filtering or async training make it unknowable."""
    if prompts is None or getattr(args, "algo.dynamic_filtering_enable") or getattr(args, "train.async_enable"):
        return None
    prompts = min(prompts, getattr(args, "data.max_samples"))
    return -(-prompts // getattr(args, "rollout.batch_size")) * getattr(args, "train.num_episodes")


def check_output_dir(flag: str, path: str | None) -> None:
    """`path` (created later, by the run) must be a directory the run can write, checked by creating a file."""
    if not path:
        return
    target = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(target) and not os.path.isdir(target):
        raise UsageError(flag, f"{target} exists and is not a directory")
    existing = target
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
        if os.path.exists(existing) and not os.path.isdir(existing):  # FILE/model: makedirs would fail at the end
            raise UsageError(flag, f"{target} cannot be created: {existing} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UsageError(flag, f"cannot write under {existing}: {err.strerror or err}") from None


def check_outputs(args: argparse.Namespace) -> None:
    """Every place the run writes to after training has started (the run directory is opened in run_dir.py)."""
    check_output_dir("--ckpt.output_dir", getattr(args, "ckpt.output_dir"))  # the final model, always saved
    best = getattr(args, "eval.dataset") and getattr(args, "ckpt.best_metric_key") != "none"  # best-eval saves
    if getattr(args, "ckpt.save_steps") > 0 or getattr(args, "ckpt.save_hf") or best:
        check_output_dir("--ckpt.path", getattr(args, "ckpt.path"))
    check_output_dir("--logger.tensorboard_dir", getattr(args, "logger.tensorboard_dir"))
    check_output_dir(UNTRAINED_CACHE_FLAG, getattr(args, "eval.untrained_cache", None))


def check_inputs(args: argparse.Namespace, spec: RunSpec) -> int | None:
    """Paths, files and the reward script, checked before anything expensive starts (after the run is resolved).

    Returns the number of steps the run will train when the prompt files tell (`planned_steps`)."""
    check_model_path("--actor.model_name_or_path", getattr(args, "actor.model_name_or_path"), required=True)
    check_routing_replay(args, cuda=spec.cluster.device == "cuda",
                         bypass_loss=spec.correction.loss if spec.correction.bypass else None)
    check_sync_layout(args)
    if not getattr(args, "reward.remote_url"):
        check_model_path("--reward.model_name_or_path", getattr(args, "reward.model_name_or_path"), required=True)
    check_model_path("--critic.model_name_or_path", getattr(args, "critic.model_name_or_path"))
    check_reward_script("--reward.remote_url", getattr(args, "reward.remote_url"))
    keys = {"--data.input_key": getattr(args, "data.input_key"), "--data.label_key": getattr(args, "data.label_key")}
    reach, modelscope = getattr(args, "data.max_samples"), getattr(args, "use_ms", False)
    train = check_dataset("--data.prompt_dataset", getattr(args, "data.prompt_dataset"), keys,
                          split=getattr(args, "data.prompt_split"), reach=reach, modelscope=modelscope)
    evaluated = check_dataset("--eval.dataset", getattr(args, "eval.dataset"), keys, required=False,
                              split=getattr(args, "eval.split"), reach=reach, modelscope=modelscope)
    check_prompt_rows(args, train.prompts + evaluated.prompts)
    check_outputs(args)
    from openrlhf_tis.cli.reward_probe import probe_reward_script
    from openrlhf_tis.rollout.precision import check_cli_precision_files

    check_cli_precision_files(getattr(args, "actor.model_name_or_path"), spec.rollout,
                              cuda=spec.cluster.device == "cuda")
    check_prompt_lengths(args, train.prompts + evaluated.prompts)
    if train.first is not None:
        probe_reward_script("--reward.remote_url", getattr(args, "reward.remote_url"), train.first, args, spec.reward)
    return planned_steps(args, train.records)


def check_routing_replay(args: argparse.Namespace, *, cuda: bool, bypass_loss: str | None = None) -> None:
    """`--vllm.routing_replay`: refused with the reason when the trainer cannot replay (a dense model, an architecture
    whose router the fork does not replace, ring attention, which slices a sample's tokens across ranks) or, for r3 and
    measure, when the rollouts cannot carry the engines' routed experts (no vLLM engine, an engine that cannot return
    them, a multi-turn agent, async training, whose sample generator is upstream's). r2 records the trainer's own π_old
    forward, so it needs no engine and nothing carried from the rollout, only that π_old forward, which a bypass loss
    (`bypass_loss`, the run's resolved correction loss when it is one: π_old := μ) skips."""
    mode = getattr(args, "vllm.routing_replay")
    if mode == "off":
        return
    if mode in ENGINE_ROUTING_MODES and not getattr(args, "vllm.num_engines"):
        raise UsageError(REPLAY_FLAG, f"{mode} reads the experts the vLLM engines chose, and this run has no engine "
                         "(--vllm.num_engines): its rollouts carry no routed experts")
    model = getattr(args, "actor.model_name_or_path")
    if refusal := replay_refusal(read_model_config("--actor.model_name_or_path", model)):
        raise UsageError(REPLAY_FLAG, f"{model}: {refusal}")
    if getattr(args, "ds.ring_attn_size", 1) > 1:
        raise UsageError(REPLAY_FLAG, f"{mode} with --ds.ring_attn_size > 1: ring attention slices each sample's "
                         "tokens across ranks, and the replayed routing is not sliced with them")
    if mode == "r2":
        if bypass_loss:
            raise UsageError(REPLAY_FLAG, f"r2 with --algo.correction.loss {bypass_loss}: r2 records the routing of "
                             "the pi_old forward, which a bypass loss skips (pi_old := mu); use r3, or the decoupled "
                             "loss")
        return
    if refusal := engine_refusal(cuda=cuda):
        raise UsageError(REPLAY_FLAG, refusal)
    unsupported = {
        "train.agent_func_path": "a multi-turn agent's later turns are routed by requests other than the sample's",
        "train.async_enable": "async training's sample generator is upstream's, which drops the routed experts",
    }
    for dest, reason in unsupported.items():
        if getattr(args, dest, None):
            raise UsageError(REPLAY_FLAG, f"{mode} with --{dest}: {reason}")


def check_sync_layout(args: argparse.Namespace) -> None:
    """Refuse, before Ray and the engines start and naming the model flag, a model whose trainer parameters the
    weight sync cannot send in its checkpoint's layout one parameter at a time (checkpoint_layout.py): read from its
    config alone, on the meta device."""
    if getattr(args, "vllm.num_engines", 0) == 0:
        return
    from transformers import AutoConfig

    from openrlhf_tis.rollout.weight_sync.checkpoint_layout import EngineLayout

    model = getattr(args, "actor.model_name_or_path")
    config = read_model_config("--actor.model_name_or_path", model)
    try:
        config = AutoConfig.for_model(**config)
    except ValueError:  # a model_type transformers does not know (remote code): nothing to tell from here
        return
    try:
        EngineLayout(config)
    except RuntimeError as err:
        raise UsageError("--actor.model_name_or_path", f"{model}: {err}") from None


def check_quantized_receive(args: argparse.Namespace, spec: RunSpec, accelerators: tuple[str, ...],
                            cluster: str) -> None:
    """A CUDA run's quantized sync against its cluster's cards (rollout/receive_budget.py), from the model
    directory's safetensors headers; nothing where the model is not a local safetensors directory."""
    from openrlhf_tis.rollout.checkpoint import largest_tensor_numel
    from openrlhf_tis.rollout.receive_budget import check_receive_fits

    if spec.cluster.device != "cuda":
        return
    model = getattr(args, "actor.model_name_or_path")
    try:
        largest = largest_tensor_numel(model) if os.path.isdir(model) else None
    except FileNotFoundError:  # no safetensors: not computed
        largest = None
    check_receive_fits(precision=spec.rollout.precision, colocated=getattr(args, "train.colocate_all"),
                       utilization=getattr(args, "vllm.gpu_memory_utilization"), accelerators=accelerators,
                       largest_numel=largest, cluster=cluster)


def check_flags(args: argparse.Namespace, *, cuda: bool, cluster: str) -> None:
    """Every check the flag values decide for a run on a CUDA (`cuda`) or CPU cluster, `cluster` naming its resources;
    no file read, nothing changed (the correction's own checks run as it is resolved: cli/resolve.py)."""
    from openrlhf_tis.cli.batch_checks import check_batches
    from openrlhf_tis.rollout.precision import check_cli_precision

    for declared in FORK_FLAGS:  # the range each declaration states
        if (problem := declared.problem(getattr(args, declared.dest))) is not None:
            raise UsageError(declared.name, problem)
    check_cadences(args)
    try:
        check_timeout(getattr(args, "reward.timeout_s"))
    except ValueError as err:
        raise UsageError(TIMEOUT_FLAG, str(err)) from None
    if (samples := getattr(args, "data.max_samples")) < 1:
        raise UsageError("--data.max_samples", f"must be >= 1, got {samples}: it caps the prompts the run trains "
                         "(and evaluates) on, so the run would train no step")
    check_async(args)
    check_batches(args)
    check_cli_precision(args, cuda=cuda, cluster=cluster)


CADENCE_FLAGS = {"--ckpt.save_steps": True, "--eval.steps": True, "--logger.logging_steps": False}
"""Upstream's every-N-steps flags (it divides the step by them) -> whether -1 is its "never" for that flag."""


def check_cadences(args: argparse.Namespace) -> None:
    """Every N steps needs N >= 1 (or upstream's -1, never): 0 passed upstream's parser and ended the run with a
    ZeroDivisionError after its first step; a negative N other than -1 would save or evaluate on a whim."""
    for flag, never in CADENCE_FLAGS.items():
        value = getattr(args, flag[2:])
        if value < 1 and not (never and value == -1):
            raise UsageError(flag, f"must be >= 1 (every N steps){' or -1 (never)' if never else ''}, got {value}")


def check_async(args: argparse.Namespace) -> None:
    """Async training's flags, refused where they cannot apply (upstream asserts some of them later, after Ray);
    and the sync cadence, a synchronous run's fixed lag (trainer/sync_cadence.py)."""
    every = getattr(args, "vllm.sync_every")
    if every > 1 and getattr(args, "train.async_enable"):
        raise UsageError("--vllm.sync_every", f"{every} fixes the lag of a synchronous run; async training's lag comes "
                         "from its queue (--train.async_queue_size, bounded by --train.async_max_lag)")
    if every > 1 and not getattr(args, "vllm.num_engines"):
        raise UsageError("--vllm.sync_every", f"{every}, but the run has no vLLM engine to sync (--vllm.num_engines)")
    if getattr(args, "train.async_enable"):
        if getattr(args, "train.async_queue_size") < 1:
            raise UsageError("--train.async_queue_size", "must be >= 1")
        if getattr(args, "vllm.enable_sleep"):
            raise UsageError("--vllm.enable_sleep", "async training keeps the engines generating; it cannot sleep them")
        lag = getattr(args, "train.async_max_lag")
        if lag is not None and lag < 0:
            raise UsageError("--train.async_max_lag", f"must be >= 0 (a lag counts policy versions), got {lag}")
        return
    only_async = {"--train.partial_rollout_enable": getattr(args, "train.partial_rollout_enable"),
                  "--train.async_max_lag": getattr(args, "train.async_max_lag") is not None,
                  "--train.async_queue_size": getattr(args, "train.async_queue_size") != 1}
    for flag, given in only_async.items():
        if given:
            raise UsageError(flag, "applies to async training only; add --train.async_enable (synchronous runs "
                             "always train on rollouts of the current policy: lag 0)")


# OpenRLHF 0.11.0's correction flags, which 0.11.2 (whose parser the fork reuses) replaced: each 0.11.0
# `--algo.advantage.is_correction_type` with the 0.11.2 level and mode that compute the same loss (0.11.0 and 0.11.2
# `openrlhf/models/loss.py`, PolicyLoss.forward) and the fork's preset for them.
UPSTREAM_0110_FLAGS = ("--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type")
UPSTREAM_0110_TYPES = {"tis": ("token", "clip", "upstream_tis"), "icepop": ("token", "mask", "upstream_icepop"),
                       "seq-mask-tis": ("seq", "mask", "upstream_seq_mask_tis")}


def upstream_0110_replacement(kind: str) -> str:
    """The OpenRLHF 0.11.2 flags for 0.11.0's `--algo.advantage.is_correction_enable --..._type <kind>`."""
    level, mode, _ = UPSTREAM_0110_TYPES[kind]
    return f"--algo.advantage.is_correction_level {level} --algo.advantage.is_correction_mode {mode}"


def refuse_upstream_0110_flags(argv: list[str]) -> None:
    """Refuse OpenRLHF 0.11.0's `--algo.advantage.is_correction_enable` / `_type` in one line naming the 0.11.2 flags
    that replace them, where argparse would only call them unrecognized. Read from `argv` before it is parsed (the
    parser does not know them); 0.11.0's `--algo.advantage.is_correction_threshold LOW HIGH` kept its meaning."""
    given, kind = [], "tis"  # 0.11.0's default type
    for i, token in enumerate(argv):
        name, eq, value = token.partition("=")
        if name in UPSTREAM_0110_FLAGS:
            given.append(name)
            if name == UPSTREAM_0110_FLAGS[1]:
                kind = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    if not given:
        return
    if kind in UPSTREAM_0110_TYPES:
        said = (f"0.11.0's --algo.advantage.is_correction_enable --algo.advantage.is_correction_type {kind} is "
                f"{upstream_0110_replacement(kind)} in 0.11.2 (= --algo.correction.preset "
                f"{UPSTREAM_0110_TYPES[kind][2]})")
    else:
        said = (f"0.11.0's types ({kind!r} is none of them) are, in 0.11.2, "
                + "; ".join(f"{name}: {upstream_0110_replacement(name)}" for name in UPSTREAM_0110_TYPES))
    if UPSTREAM_0110_FLAGS[0] not in given:
        said = f"without --algo.advantage.is_correction_enable it did nothing (drop it); {said}"
    raise UsageError(given[0], f"OpenRLHF 0.11.0's flag, gone from 0.11.2, which the fork runs: {said}; "
                     "--algo.advantage.is_correction_threshold keeps its meaning")
