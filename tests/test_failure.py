"""Why a notebook's job failed (pipeline/failure.py), on log text as a training writes it: Ray's coloured actor
prefixes, upstream's per-step metrics dicts (whose keys hold the word "error"), then the real error; and the main
job's console on such a failure: the cause in one line, no traceback."""

from __future__ import annotations

import signal
import textwrap

import pytest
from papermill.exceptions import PapermillExecutionError

from openrlhf_tis.pipeline.failure import cause, failure, notebook_error

PREFIX = "\x1b[36m(_TisPPOTrainer pid=30242)\x1b[0m "
METRICS = ("INFO 11-26 09:34:17 ppo_trainer.py:551] ✨ Global step {step}: {{'mismatch/abs_dlogp_p0.001-0.01': "
           "0.5555905411416725, 'kl': 0.0, 'rollout/int8_saturated_fraction': 0.0, 'rollout/int8_max_rel_error': "
           "0.016129032689697887, 'rollout/int8_quantize_s': 0.41, 'timing/step_total': 31.2}}")
STEPS = "".join(f"{PREFIX}{METRICS.format(step=step)}\n{PREFIX}Episode [1/1]:  {step * 4}%|█▎        | {step}/24\n"
                for step in (9, 10, 11))
WARNING = ("\x1b[0;36m(MainProcess pid=28651)\x1b[0;0m \x1b[33mWARNING\x1b[0m [cpu_worker.py:140] CPU backend doesn't "
           "allow to use `torch.set_num_threads` after the thread binding, skip it.\n")
ACTOR_DIED = textwrap.dedent("""\
    Traceback (most recent call last):
      File "/work/main/.venv/lib/python3.11/site-packages/openrlhf/cli/train_ppo_ray.py", line 188, in train
        ray.get(ppo_trainer.fit.remote())
      File "/work/main/.venv/lib/python3.11/site-packages/ray/_private/worker.py", line 2961, in get
        values, debugger_breakpoint = worker.get_objects(object_refs, timeout=timeout)
    ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.
    \tclass_name: _TisPPOTrainer
    \tpid: 30242
    The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker \
    unexpectedly exits with a connection error code 2. End of file.
    """)


def test_the_cause_is_the_error_line_never_a_metrics_dict_that_holds_the_word():
    tail = STEPS + WARNING + ACTOR_DIED + PREFIX + METRICS.format(step=12) + "\n"
    assert cause(tail) == "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task."
    wrapped = STEPS + PREFIX + "ray.exceptions.RayTaskError(ValueError): ray::_TisPPOTrainer.fit() (pid=30242)\n" + \
        PREFIX + "ValueError: rollout log-probs are NaN\n" + WARNING
    assert cause(wrapped) == "ValueError: rollout log-probs are NaN"  # the innermost error, Ray's prefix gone
    usage = "starting\nValueError: first\nopenrlhf_tis.cli.train_ppo_ray: error: --x: bad\nshutting down\n"
    assert cause(usage) == "openrlhf_tis.cli.train_ppo_ray: error: --x: bad"
    assert cause("only\nlines\n") == "lines" and cause("") == "(empty log)"
    assert "int8_max_rel_error" in cause(STEPS + PREFIX + "Episode done\n" + PREFIX + METRICS.format(step=12))


def test_a_training_killed_by_a_signal_says_so_and_one_that_failed_names_its_error(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(STEPS + WARNING)  # a kill -9 leaves no error in the log: the last steps' metrics
    killed = failure("training", -signal.SIGKILL, log)
    assert killed.splitlines()[0] == ("training was killed by SIGKILL from outside it (another process, or the "
                                      "kernel's OOM killer)")
    assert killed.splitlines()[1] == f"full log: {log}; its tail:" and killed.endswith(WARNING.strip())
    log.write_text(STEPS + ACTOR_DIED)
    assert failure("training", 1, log).splitlines()[0] == (
        "training exited with code 1: ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing "
        "this task.")


def test_the_main_job_prints_a_failed_training_as_its_cause_without_tracebacks(tmp_path, monkeypatch, capsys):
    from openrlhf_tis.pipeline import main_job

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "train.log").write_text(STEPS + WARNING)
    evalue = failure("training", -signal.SIGKILL, run_dir / "train.log")

    def execute_stoppable(name, notebook, params, cwd, wait):  # the kernel's cell raised TrainingFailed
        raise PapermillExecutionError(3, 3, "run_training(params)", "TrainingFailed", evalue,
                                      ["Traceback (most recent call last):", "TrainingFailed: " + evalue])

    monkeypatch.setattr(main_job, "execute_stoppable", execute_stoppable)
    monkeypatch.setattr(main_job, "export_html", lambda notebook, html: html)
    monkeypatch.setattr(main_job, "check_training_command", lambda params, cluster=None: None)
    with pytest.raises(SystemExit) as ended:
        main_job.main(["--out", str(tmp_path), "--model", "tiny", "--set", f"run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert ended.value.code == 1 and "Traceback" not in err
    lines = err.splitlines()
    assert lines[1] == ("main_job: error: the training notebook failed at cell 3: TrainingFailed: training was killed "
                        "by SIGKILL from outside it (another process, or the kernel's OOM killer)")
    assert lines[2] == f"report: {run_dir / 'report.html'}; full log: {run_dir / 'train.log'}; its last 20 lines:"


def test_notebook_error_names_the_cell_and_the_first_line_of_the_exception():
    err = PapermillExecutionError(2, 2, "x", "TrainingFailed", "training exited with code 2: bad\nfull log: l", [])
    assert notebook_error(err) == "cell 2: TrainingFailed: training exited with code 2: bad"
    assert notebook_error(RuntimeError("boom\nmore")) == "RuntimeError: boom"
