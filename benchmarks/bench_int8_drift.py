"""INT8 weight-scale drift: recomputed vs frozen per-channel scales while a real model trains (docs/design.md §4).

    python benchmarks/bench_int8_drift.py [--model DIR | --tiny] [--lrs 1e-6,1e-5,1e-4] [--steps 30]
        [--loss lm|pg] [--eval-every 10] [--validate-vllm] [--threads 1] [--out rows.json|rows.csv]
        [--plot drift.png]

On a shared 2-core machine pass --threads 1: with two OpenMP threads and another busy process, a
training step took ~45 s instead of ~5 s (threads spin at every barrier while one is descheduled).

An INT8 W8A8 rollout engine is re-quantized from the trainer's bf16 weights at every sync. Its
per-output-channel weight scales are either recomputed from the new weights ("recompute": never
saturates) or frozen at the step-0 values ("frozen": values beyond ±127.5·s clamp). For each learning
rate the script trains the model from the same start and, at every step, quantizes the synced bf16
weights both ways with the fork's own sync function (`quantize_named_weights`) and records
- saturation: clamped values (count, fraction), rows with any clamped value, max |w|/(127·s);
- weight error: ||w - dq(q(w))|| / ||w|| over all projections (every 5th step and at evaluations), and
  the max per-tensor max|w - dq| / max|w| (QuantStats.max_rel_error);
- every `--eval-every` steps, the output mismatch of an emulated W8A8 engine against the fp32 forward
  of the same bf16 weights (the trainer), on completions sampled from the current bf16 model (fixed
  prompts and seed): per token r = log pi - log mu, k3 = E[exp(r) - 1 - r], mean |r|, fraction of
  exp(r) outside [0.5, 2], and the exact full-vocabulary KL(mu || pi) per position; the same KL for
  the dequantized int8 weights run in fp32 ("W8": no activation rounding, no bf16 rounding, so it
  isolates what the weight scales do, free of the chaotic per-token rounding noise); and
  KL(frozen || recompute) for both, what freezing alone changes. A bf16 engine (no int8) is the
  baseline row.

Training: a bf16 model (forward/backward in bf16, what the trainer syncs) with fp32 master weights
updated by plain torch AdamW (betas 0.9/0.95, grad clip 1, OpenRLHF's defaults), i.e. DeepSpeed's
bf16 mixed precision. Pure bf16 AdamW (`--master bf16`) drops every update below half a bf16 ulp, so
at RL learning rates the weights would not move at all. Loss `lm` (default): next-token loss on one
fixed batch of arithmetic text: a strong training signal that points the same way every step (the
model memorizes the batch), a stress case for drift at a given lr. Loss `pg`: on-policy REINFORCE
with a group-mean/std baseline (GRPO's gradient for one update per rollout batch) on completions
sampled every step, scored by the demo task's dense reward (demo/dense_reward.py): closer to RL.
A larger lr stands in for a longer run. The drift column reports how far the synced weights moved.

The W8A8 engine is emulated in torch (bf16 model; each projection: input fake-quantized per token,
symmetric, scale max|x|/127, times the dequantized int8 weight in fp32, output cast back to bf16);
`--validate-vllm` compares the emulation once with real vLLM-CPU INT8 and bf16 engines on the step-0
checkpoint (prompt log-probs of the eval batch).
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from openrlhf_tis.demo.dense_reward import DIGIT_WEIGHT  # noqa: E402
from openrlhf_tis.demo.task import all_problems, score  # noqa: E402
from openrlhf_tis.demo.task_reward import shaped  # noqa: E402
from openrlhf_tis.rollout.quantize import (  # noqa: E402
    INT8_MAX,
    INT8_MIN,
    Int8Plan,
    dequantize,
    is_quantized_weight,
    per_channel_scale,
    quantize_named_weights,
    scale_name,
)

MODES = ("recompute", "frozen")
PROBLEMS = all_problems()


# ---------------------------------------------------------------------------------------------- data


def _question(rng: random.Random) -> tuple[str, int]:
    """A question of the demo task, prompted for its tagged answer (the model is not chat-formatted here)."""
    problem = rng.choice(PROBLEMS)
    return f"{problem.question}\nAnswer:", problem.answer


def equal_length_prompts(tok, n: int, seed: int) -> list[tuple[list[int], int]]:
    """n (token ids, answer) arithmetic prompts that all tokenize to the same length: no padding anywhere."""
    rng = random.Random(seed)
    cands = [_question(rng) for _ in range(20 * n)]
    ids = [(tok(q).input_ids, a) for q, a in cands]
    length = statistics.mode(len(i) for i, _ in ids)
    same = [(i, a) for i, a in ids if len(i) == length]
    if len(same) < n:
        raise ValueError(f"only {len(same)} equal-length prompts, need {n}")
    return same[:n]


def lm_batch(tok, batch: int, seq: int, seed: int) -> torch.Tensor:
    """A fixed [batch, seq] block of the demo task's questions with their answers, cut from one token stream."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < batch * seq:
        problem = rng.choice(PROBLEMS)
        ids += tok(f"{problem.question}\nAnswer: {problem.answer}\n").input_ids
    return torch.tensor(ids[: batch * seq]).view(batch, seq)


@torch.no_grad()
def sample(model, prompts: torch.Tensor, new_tokens: int, seed: int) -> torch.Tensor:
    """Prompts + exactly `new_tokens` tokens sampled at temperature 1 (no top-k/p, EOS suppressed)."""
    torch.manual_seed(seed)
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                          top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          pad_token_id=0)


# ------------------------------------------------------------------------------------------ training


class Trainer:
    """bf16 model + fp32 master weights + AdamW: the weights a DeepSpeed bf16 actor would sync."""

    def __init__(self, model, lr: float, master: str, weight_decay: float):
        self.model = model
        self.params = [p for p in model.parameters()]
        if master == "fp32":
            self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        else:
            self.master = self.params
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    def step(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.master is not self.params:
            for m, p in zip(self.master, self.params, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(self.master, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.master is not self.params:
            with torch.no_grad():
                for m, p in zip(self.master, self.params, strict=True):
                    p.copy_(m)  # round to nearest bf16: the synced weights


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    return model(batch, labels=batch).loss


def pg_loss(model, tok, prompts: list[tuple[list[int], int]], group: int, new_tokens: int, seed: int):
    """REINFORCE with group baseline on fresh samples; returns (loss, mean reward)."""
    ids = torch.tensor([p for p, _ in prompts]).repeat_interleave(group, 0)
    answers = [a for _, a in prompts for _ in range(group)]
    model.eval()
    seqs = sample(model, ids, new_tokens, seed)
    model.train()
    plen = ids.shape[1]
    rewards = torch.tensor([shaped(score(tok.decode(s[plen:]), str(a)), DIGIT_WEIGHT)
                            for s, a in zip(seqs, answers, strict=True)])
    r = rewards.view(-1, group)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    logits = model(seqs).logits[:, plen - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, seqs[:, plen:, None])[..., 0]
    return -(adv[:, None] * lp).mean(), float(rewards.mean())


# ------------------------------------------------------------------------------------ quantization


def quantize_both(named: list[tuple[str, torch.Tensor]], frozen: dict[str, torch.Tensor],
                  init_amax: dict[str, torch.Tensor], w0: dict[str, torch.Tensor], detail: bool = True) -> dict:
    """Quantize the synced bf16 weights with each scale mode; stats and the int8 weights per mode.

    Saturation comes from per-row extremes (cheap, every step); the full-tensor passes (weight error,
    drift) only run when `detail` is set: on 2 shared cores each costs seconds at 135M.
    """
    out: dict = {}
    rowmax = {n: w.amax(1).float() for n, w in named if is_quantized_weight(n)}
    rowmin = {n: w.amin(1).float() for n, w in named if is_quantized_weight(n)}
    for mode in MODES:
        plan = Int8Plan(scale_mode=mode, frozen_scales=frozen if mode == "frozen" else {})
        t0 = time.perf_counter()
        qnamed, stats = quantize_named_weights(named, plan, torch.bfloat16)  # exactly what a sync runs
        quant_s = time.perf_counter() - t0
        qd = dict(qnamed)
        rows_sat = rows = 0
        overshoot = 0.0
        err2 = ref2 = 0.0
        for name, w in named:
            if not is_quantized_weight(name):
                continue
            s = qd[scale_name(name)][:, 0]
            hi, lo = torch.round(rowmax[name] / s), torch.round(rowmin[name] / s)
            rows_sat += int(((hi > INT8_MAX) | (lo < INT8_MIN)).sum())
            rows += w.shape[0]
            overshoot = max(overshoot, float(torch.maximum(rowmax[name], -rowmin[name]).div(s).max()) / INT8_MAX)
            if detail:
                wf = w.float()
                err2 += float((wf - qd[name].float() * s[:, None]).square().sum())
                ref2 += float(wf.square().sum())
        out[mode] = {"quantize_s": quant_s, "saturated": stats.saturated,
                     "saturated_fraction": stats.saturated_fraction, "rows_saturated": rows_sat,
                     "rows_saturated_fraction": rows_sat / rows, "max_overshoot": overshoot,
                     "max_rel_err": stats.max_rel_error, "_q": qd}
        if detail:
            out[mode]["rel_err"] = math.sqrt(err2 / ref2)
    # drift of the synced weights since step 0 (shared by both modes)
    up = sum(int((torch.maximum(rowmax[n], -rowmin[n]) > init_amax[n]).sum()) for n in rowmax)
    out["drift"] = {"rows_amax_up": up / sum(v.numel() for v in rowmax.values())}
    if detail:
        d2 = sum(float((w.float() - w0[n]).square().sum()) for n, w in named if n in w0)
        out["drift"]["drift_rel"] = math.sqrt(d2 / sum(float(v.square().sum()) for v in w0.values()))
    return out


class W8A8Linear(nn.Module):
    """Emulated vLLM W8A8 int8 GEMM: per-token symmetric int8 input x per-channel int8 weight.

    Integer products are summed in fp32 (exact while |sum| < 2^24, nearly always), then scaled by
    s_x * s_w and cast to the engine dtype, as the int32-accumulating kernel does.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.register_buffer("wq", torch.zeros_like(linear.weight, dtype=torch.float32), persistent=False)
        self.register_buffer("scale", torch.ones(1, linear.out_features), persistent=False)
        self.bias = linear.bias  # Qwen2's q/k/v biases: added after the int8 GEMM, in the engine dtype

    def set(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.wq = q.float()
        self.scale = scale.float().reshape(1, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sx = xf.abs().amax(-1, keepdim=True).clamp(min=1e-30) / INT8_MAX
        xq = torch.round(xf / sx).clamp_(INT8_MIN, INT8_MAX)
        y = ((xq @ self.wq.T) * (sx * self.scale)).to(x.dtype)
        return y if self.bias is None else y + self.bias


def make_emulator(model) -> tuple[nn.Module, dict[str, W8A8Linear]]:
    """A bf16 copy of the model with every quantized projection replaced by a W8A8Linear."""
    emu = copy.deepcopy(model).to(torch.bfloat16).eval()
    slots = {}
    for name, mod in list(emu.named_modules()):
        if isinstance(mod, nn.Linear) and is_quantized_weight(name + ".weight"):
            parent, child = name.rsplit(".", 1)
            slot = W8A8Linear(mod)
            setattr(emu.get_submodule(parent), child, slot)
            slots[name + ".weight"] = slot
    return emu, slots


# ------------------------------------------------------------------------------------------ mismatch


def token_logprobs(logits: torch.Tensor, seqs: torch.Tensor, plen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(full log-softmax over the completion positions, log-prob of each completion token)."""
    lsm = torch.log_softmax(logits[:, plen - 1:-1].float(), -1)
    return lsm, lsm.gather(-1, seqs[:, plen:, None])[..., 0]


def exact_kl(p_lsm: torch.Tensor, q_lsm: torch.Tensor) -> float:
    """KL(p || q) over the whole vocabulary, averaged over positions."""
    return float((p_lsm.exp() * (p_lsm - q_lsm)).sum(-1).mean())


def mismatch(ref: tuple[torch.Tensor, torch.Tensor], roll: tuple[torch.Tensor, torch.Tensor], prefix: str = "") -> dict:
    """Trainer pi (ref) vs rollout mu on the eval tokens; KL(mu || pi) also exactly over the vocab."""
    r = (ref[1] - roll[1]).double().flatten()
    ratio = r.exp()
    out = {"k3": float((ratio - 1 - r).mean()), "mean_abs_dlogp": float(r.abs().mean()),
           "out_0.5_2": float(((ratio < 0.5) | (ratio > 2)).double().mean()), "kl_exact": exact_kl(roll[0], ref[0])}
    return {prefix + k: v for k, v in out.items()}


@torch.no_grad()
def evaluate(trainer_model, ref_model, emu, slots, quant: dict, prompts: torch.Tensor, new_tokens: int,
             seqs: torch.Tensor | None = None) -> tuple[dict[str, dict], torch.Tensor]:
    """Mismatch of the bf16 engine and of each W8A8 mode against the fp32 forward of the synced weights.

    Without `seqs`, the completions are sampled afresh from the current bf16 model (fixed seed): the
    tokens a rollout would produce now. Scoring samples of the step-0 model instead would grade an ever
    more off-policy text, whose low-probability tokens carry most of the mismatch.
    """
    plen = prompts.shape[1]
    if seqs is None:
        seqs = sample(trainer_model, prompts, new_tokens, seed=0)
    for pr, p in zip(ref_model.parameters(), trainer_model.parameters(), strict=True):
        pr.copy_(p)
    ref = token_logprobs(ref_model(seqs).logits, seqs, plen)
    res = {"bf16": mismatch(ref, token_logprobs(trainer_model(seqs).logits, seqs, plen))}
    trained = dict(trainer_model.named_parameters())
    for name, pe in emu.named_parameters():
        pe.copy_(trained[name])  # embeddings, norms, biases: everything the engine keeps in bf16
    ref_params = dict(ref_model.named_parameters())
    lsm: dict[tuple[str, str], torch.Tensor] = {}
    for mode in MODES:
        qd = quant[mode]["_q"]
        for name, slot in slots.items():
            slot.set(qd[name], qd[scale_name(name)])
            ref_params[name].copy_(dequantize(qd[name], qd[scale_name(name)]))  # fp32 weight-only int8
        roll = token_logprobs(emu(seqs).logits, seqs, plen)
        roll_w8 = token_logprobs(ref_model(seqs).logits, seqs, plen)
        res[mode] = {**mismatch(ref, roll), **mismatch(ref, roll_w8, "w8_")}
        lsm[mode, ""], lsm[mode, "w8_"] = roll[0], roll_w8[0]
    for prefix in ("", "w8_"):  # what freezing alone changes
        res["frozen"][prefix + "kl_vs_recompute"] = exact_kl(lsm["frozen", prefix], lsm["recompute", prefix])
    for name in slots:
        ref_params[name].copy_(trained[name])  # ref_model is the fp32 trainer again
    return res, seqs


def validate_vllm(src: Path, work: Path, seqs: torch.Tensor, plen: int, ref_lp: torch.Tensor,
                  emu_lp: dict[str, torch.Tensor]) -> dict:
    """Step 0: real vLLM-CPU INT8 and bf16 engines vs the emulation, prompt log-probs of the eval batch."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from openrlhf_tis import patches
    from openrlhf_tis.rollout.checkpoint import write_rollout_model

    patches.apply_platform_patches("cpu")  # vLLM-CPU engines in this process
    out = {}
    for variant, model_dir in (("int8", write_rollout_model(src, work / "int8", precision="int8")), ("bf16", src)):
        llm = LLM(model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=seqs.shape[1] + 8,
                  seed=0, distributed_executor_backend="uni", max_logprobs=1)
        res = llm.generate([TokensPrompt(prompt_token_ids=s.tolist()) for s in seqs],
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        lp = torch.tensor([[o.prompt_logprobs[i][t].logprob for i, t in enumerate(o.prompt_token_ids) if i >= plen]
                           for o in res])
        emu = emu_lp["recompute" if variant == "int8" else "bf16"]
        d_ref, d_emu = lp - ref_lp, lp - emu
        r_vllm, r_emu = (ref_lp - lp).double(), (ref_lp - emu).double()
        out[variant] = {"vllm_vs_fp32_k3": float((r_vllm.exp() - 1 - r_vllm).mean()),
                        "emul_vs_fp32_k3": float((r_emu.exp() - 1 - r_emu).mean()),
                        "vllm_vs_fp32_out_0.5_2": float((r_vllm.abs() > math.log(2)).double().mean()),
                        "emul_vs_fp32_out_0.5_2": float((r_emu.abs() > math.log(2)).double().mean()),
                        "vllm_vs_fp32_abs_dlogp": float(d_ref.abs().mean()),
                        "emul_vs_fp32_abs_dlogp": float((emu - ref_lp).abs().mean()),
                        "vllm_vs_emul_abs_dlogp": float(d_emu.abs().mean()),
                        "corr_of_deviations": float(torch.corrcoef(torch.stack([d_ref.flatten(),
                                                                                  (emu - ref_lp).flatten()]))[0, 1])}
        del llm
        gc.collect()
    return out


# ---------------------------------------------------------------------------------------------- main


def run_lr(lr: float, args, base, tok, train_batch, pg_prompts, eval_prompts, frozen, init_amax, w0,
           step0: dict, progress) -> list[dict]:
    """Train a fresh bf16 copy at this lr; one row per (step, mode) where measured."""
    model = copy.deepcopy(base).train()
    trainer = Trainer(model, lr, args.master, args.weight_decay)
    ref_model = copy.deepcopy(base).float().eval()
    emu, slots = make_emulator(base)
    rows = [{"lr": lr, **r} for r in step0["rows"]]
    task = progress.add_task(f"lr {lr:g}", total=args.steps)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        if args.loss == "lm":
            loss, reward = lm_loss(model, train_batch), None
        else:
            loss, reward = pg_loss(model, tok, pg_prompts, args.group, args.pg_tokens, seed=step)
        trainer.step(loss)
        train_s = time.perf_counter() - t0
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        is_eval = step % args.eval_every == 0 or step == args.steps
        quant = quantize_both(named, frozen, init_amax, w0, detail=is_eval or step % 5 == 0 or step == 1)
        mism = None
        if is_eval:
            model.eval()
            t_eval = time.perf_counter()
            mism, _ = evaluate(model, ref_model, emu, slots, quant, eval_prompts, args.eval_tokens,
                               None if args.eval_resample else step0["seqs"])
            model.train()
        common = {"lr": lr, "step": step, "loss": float(loss.detach()), "reward": reward, "train_s": train_s,
                  **({"eval_s": time.perf_counter() - t_eval} if mism else {}), **quant["drift"]}
        for mode in (*MODES, "bf16"):
            row = {**common, "mode": mode}
            if mode in quant:
                row.update({k: v for k, v in quant[mode].items() if not k.startswith("_")})
            if mism:
                row.update(mism[mode])
            if mode != "bf16" or mism:
                rows.append(row)
        if mism:  # a log line per evaluation (a non-terminal console shows no live bar)
            fz, rc = mism["frozen"], mism["recompute"]
            progress.console.print(
                f"lr {lr:g} step {step} (train {train_s:.1f} s, eval {common['eval_s']:.0f} s, load "
                f"{os.getloadavg()[0]:.1f}): loss {common['loss']:.3f}, drift {common['drift_rel']:.2e}, frozen "
                f"saturated {quant['frozen']['saturated_fraction']:.2e}; KL recompute {rc['kl_exact']:.3e}, "
                f"frozen {fz['kl_exact']:.3e}, bf16 {mism['bf16']['kl_exact']:.3e}, frozen vs recompute "
                f"{fz['kl_vs_recompute']:.3e} (weight-only {fz['w8_kl_vs_recompute']:.3e})")
        progress.update(task, advance=1, description=f"lr {lr:g} loss {common['loss']:.3f} "
                        f"sat {quant['frozen']['saturated_fraction']:.1e}")
    del model, trainer, ref_model, emu
    gc.collect()
    return rows


def print_tables(rows: list[dict], console) -> None:
    """One table per lr: eval steps and every 5th step, one line per mode (the file has every step)."""
    from rich.table import Table

    def f(r, key, spec=".2e"):
        return "-" if r.get(key) is None else format(r[key], spec)

    for lr in sorted({r["lr"] for r in rows}):
        table = Table(title=f"lr {lr:g}: emulated W8A8 (recompute / frozen scales) and a bf16 engine vs the fp32 "
                      "trainer. KL: exact KL(mu||pi) per token; W8: int8 weights run in fp32, no activation quant; "
                      "vs R: KL(frozen||recompute)")
        for col in ("step", "mode", "drift", "rows max↑", "saturated (count)", "rows sat", "max |w|/127s",
                    "rel err", "k3", "|Δlogp|", "out [.5,2]", "KL", "KL W8", "KL vs R", "KL W8 vs R", "quant s"):
            table.add_column(col, justify="right")
        for r in rows:
            if r["lr"] != lr or "rel_err" not in r and r["mode"] != "bf16":
                continue
            quant = r["mode"] != "bf16"
            table.add_row(
                str(r["step"]), r["mode"], f(r, "drift_rel"), f(r, "rows_amax_up", ".3f"),
                f"{r['saturated_fraction']:.2e} ({r['saturated']})" if quant else "",
                f(r, "rows_saturated_fraction", ".4f") if quant else "", f(r, "max_overshoot", ".4f") if quant else "",
                f(r, "rel_err", ".4f") if quant else "", f(r, "k3"), f(r, "mean_abs_dlogp", ".4f"),
                f(r, "out_0.5_2", ".4f"), f(r, "kl_exact"), f(r, "w8_kl_exact") if quant else "",
                f(r, "kl_vs_recompute") if r["mode"] == "frozen" else "",
                f(r, "w8_kl_vs_recompute") if r["mode"] == "frozen" else "",
                f(r, "quantize_s", ".2f") if quant else "", end_section=r["mode"] == "bf16" or (
                    r["mode"] == "frozen" and "k3" not in r))
        console.print(table)


def write_rows(rows: list[dict], path: str, meta: dict) -> None:
    if path.endswith(".csv"):
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(path, "w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        Path(path).with_suffix(".meta.json").write_text(json.dumps(meta, indent=2))
    else:
        Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


def plot(rows: list[dict], path: str) -> None:
    """Saturation, weight error, W8A8 KL and weight-only KL vs step; colour = lr, line style = mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = (("saturated_fraction", "saturated fraction of weights (frozen)"),
              ("rel_err", "relative weight error ||w-dq||/||w||"),
              ("kl_exact", "KL(mu||pi) per token, W8A8 (bf16 engine dotted)"),
              ("w8_kl_exact", "KL per token, int8 weights only (fp32)"))
    for i, lr in enumerate(sorted({r["lr"] for r in rows})):
        for mode, style in (("recompute", "-"), ("frozen", "--"), ("bf16", ":")):
            pts = [r for r in rows if r["lr"] == lr and r["mode"] == mode]
            for ax, (key, _) in zip(axes, panels, strict=True):
                sel = [r for r in pts if r.get(key) is not None]
                if sel:
                    ax.plot([r["step"] for r in sel], [r[key] for r in sel], style, color=colors[i % len(colors)],
                            marker="o" if "kl" in key else None, label=f"lr {lr:g} {mode}")
    for ax, (_, title) in zip(axes, panels, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("symlog", linthresh=1e-7)
    axes[2].set_yscale("log")
    axes[3].set_yscale("log")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF model dir with safetensors (Llama/Qwen-style); default: the embedded "
                        "SmolLM2-135M-Instruct")
    parser.add_argument("--tiny", action="store_true", help="build and use the tiny random Qwen2 instead")
    parser.add_argument("--lrs", default="1e-6,1e-5,1e-4", help="comma-separated learning rates")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--loss", choices=("lm", "pg"), default="lm")
    parser.add_argument("--batch", type=int, default=16, help="training sequences (lm) or samples (pg) per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per training sequence (lm)")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (pg)")
    parser.add_argument("--pg-tokens", type=int, default=16, help="sampled tokens per completion (pg)")
    parser.add_argument("--master", choices=("fp32", "bf16"), default="fp32", help="AdamW master weights")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=10, help="steps between mismatch evaluations")
    parser.add_argument("--eval-seqs", type=int, default=8, help="eval completions (prompts)")
    parser.add_argument("--eval-fixed", dest="eval_resample", action="store_false",
                        help="score the step-0 samples at every evaluation (default: resample from the current model)")
    parser.add_argument("--eval-tokens", type=int, default=48, help="sampled tokens per eval completion")
    parser.add_argument("--validate-vllm", action="store_true", help="compare the emulation with vLLM-CPU at step 0")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", help="write the rows here (.csv, else JSON)")
    parser.add_argument("--plot", help="write a PNG: saturation, weight error and k3 vs step")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console() if Console().is_terminal else Console(width=200)
    work = Path(tempfile.mkdtemp(prefix="bench_int8_drift_"))
    if args.tiny:
        from openrlhf_tis.demo.tiny_model import build_tiny_model

        src = build_tiny_model(work / "tiny_model")
    elif args.model is None:
        from openrlhf_tis.demo.default_model import ensure_default_model

        src = ensure_default_model()
    else:
        src = Path(args.model)
        if not (src / "config.json").is_file():
            parser.error(f"{src} is not a model directory (pass --model DIR or --tiny)")
    tok = AutoTokenizer.from_pretrained(src)
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)  # the trainer's synced weights
    base.generation_config.eos_token_id = None
    named0 = [(n, p.detach().clone()) for n, p in base.named_parameters()]
    nq = sum(p.numel() for n, p in named0 if is_quantized_weight(n))
    if nq == 0:
        parser.error(f"{src}: no decoder projections to quantize")
    frozen = {scale_name(n): per_channel_scale(p) for n, p in named0 if is_quantized_weight(n)}
    init_amax = {n: p.float().abs().amax(1) for n, p in named0 if is_quantized_weight(n)}
    w0 = {n: p.float() for n, p in named0 if is_quantized_weight(n)}
    row_max = torch.cat(list(init_amax.values()))
    console.print(f"model {src}: {nq / 1e6:.1f}M quantized of {sum(p.numel() for _, p in named0) / 1e6:.1f}M "
                  f"params; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, {torch.get_num_threads()} "
                  f"threads; loss {args.loss}, master {args.master}")

    # Fixed data: the training batch (lm) or prompts (pg), and the eval prompts.
    train_batch = lm_batch(tok, args.batch, args.seq, seed=1)
    pg_prompts = equal_length_prompts(tok, max(1, args.batch // args.group), seed=2)
    eval_prompts = torch.tensor([p for p, _ in equal_length_prompts(tok, args.eval_seqs, seed=3)])
    plen = eval_prompts.shape[1]

    # Step 0 is shared by every lr (same start): quantize once, evaluate once.
    fp32 = copy.deepcopy(base).float().eval()
    quant0 = quantize_both(named0, frozen, init_amax, w0)
    emu, slots = make_emulator(base)
    mism0, seqs = evaluate(base.eval(), fp32, emu, slots, quant0, eval_prompts, args.eval_tokens)
    console.print(f"eval batch {tuple(seqs.shape)} (prompt {plen} tokens, completions sampled from the bf16 model "
                  f"{'at each evaluation' if args.eval_resample else 'at step 0'}); e.g. "
                  f"{tok.decode(seqs[0, plen:])[:80]!r}")
    step0_rows = []
    for mode in (*MODES, "bf16"):
        row = {"step": 0, "mode": mode, "loss": None, "reward": None, "train_s": None, **quant0["drift"],
               **mism0[mode]}
        if mode in quant0:
            row.update({k: v for k, v in quant0[mode].items() if not k.startswith("_")})
        step0_rows.append(row)
    meta = {"model": str(src), "args": vars(args), "quantized_params": nq, "eval_shape": list(seqs.shape),
            "load_at_start": os.getloadavg()[0], "torch_threads": torch.get_num_threads(),
            "row_amax_min": float(row_max.min()), "row_amax_median": float(row_max.median())}
    # A frozen scale clamps once a row's max |w| exceeds 127.5/127 of its initial value m. In bf16 the
    # next value above m is m + ulp(m), ulp/m in (1/256, 1/128]: so one ulp up nearly always clamps, and
    # the fp32 master reaches it after moving half an ulp (>= m/512). Adam moves a weight by about lr
    # per step at most, hence a floor on the steps to a row's first clamped value: m / (512 lr).
    for lr in (float(x) for x in args.lrs.split(",")):
        meta[f"steps_to_first_possible_saturation_lr{lr:g}"] = {
            "min_row": float(row_max.min() / (512 * lr)), "median_row": float(row_max.median() / (512 * lr))}
    console.print(f"row max |w|: min {row_max.min():.4f}, median {row_max.median():.4f} -> at <= lr per step a "
                  f"frozen scale can first clamp after >= max|w|/(512 lr) steps: " + ", ".join(
                      f"lr {lr}: {v['min_row']:.0f} (min row) / {v['median_row']:.0f} (median row)"
                      for lr, v in ((k.rsplit("lr", 1)[1], v) for k, v in meta.items()
                                    if k.startswith("steps_to_first"))))

    emu_lp = None
    if args.validate_vllm:  # the step-0 emulation, compared with vLLM after training (vLLM pins threads)
        with torch.no_grad():
            ref_lp = token_logprobs(fp32(seqs).logits, seqs, plen)[1]
            emu_lp = {"bf16": token_logprobs(base(seqs).logits, seqs, plen)[1]}
            for name, slot in slots.items():
                slot.set(quant0["recompute"]["_q"][name], quant0["recompute"]["_q"][scale_name(name)])
            emu_lp["recompute"] = token_logprobs(emu(seqs).logits, seqs, plen)[1]
    del emu, fp32, quant0
    gc.collect()

    rows: list[dict] = []
    t_start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not console.is_terminal) as progress:  # logs: eval lines only
        for lr in (float(x) for x in args.lrs.split(",")):
            rows += run_lr(lr, args, base, tok, train_batch, pg_prompts, eval_prompts, frozen, init_amax, w0,
                           {"rows": step0_rows, "seqs": seqs}, progress)
            if args.out:  # keep what is done if a later lr is interrupted
                write_rows(rows, args.out, meta)
    meta["wall_s"] = time.perf_counter() - t_start
    meta["load_at_end"] = os.getloadavg()[0]
    if emu_lp is not None:
        t0 = time.perf_counter()
        meta["vllm_validation"] = validate_vllm(src, work, seqs, plen, ref_lp, emu_lp)
        console.print(f"vLLM validation ({time.perf_counter() - t0:.0f} s): "
                      f"{json.dumps(meta['vllm_validation'], indent=1)}")
    print_tables(rows, console)
    qs = [r["quantize_s"] for r in rows if r["mode"] in MODES]
    console.print(f"quantize_named_weights per sync ({nq / 1e6:.1f}M params, incl. its error stat): median "
                  f"{statistics.median(qs):.3f} s, min {min(qs):.3f} s; wall {meta['wall_s']:.0f} s; "
                  f"load {meta['load_at_start']:.1f} -> {meta['load_at_end']:.1f}")
    if args.out:
        write_rows(rows, args.out, meta)
    if args.plot:
        plot(rows, args.plot)
    shutil.rmtree(work, ignore_errors=True)  # the built tiny model / INT8 checkpoint


if __name__ == "__main__":
    main()
