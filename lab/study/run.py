"""One run of the study: one (task, arm, seed) trained from the task's warm start, evaluated as it goes, recorded.

`run_one` trains with TRL's `GRPOTrainer` or `ExGRPOTrainer` (public API and config switches only), evaluates
held-out pass@1 every `eval_every` updates, and saves one small JSON: settings, curves, per-step logs, per-generation-
batch records (`batch_record`), end-of-run probes and final figures. An ExGRPOTrainer run checkpoints every
`checkpoint_every(task)` updates, and a killed one resumes from its newest complete checkpoint to the same record.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .tasks import ARMS, PROBE_QUESTIONS, Task, arm_settings


def _config_kwargs(task: Task, seed: int, output_dir: str) -> dict:
    return dict(
        output_dir=output_dir,
        max_steps=task.steps,
        per_device_train_batch_size=task.prompts_per_step * task.num_generations,
        steps_per_generation=task.steps_per_generation,
        num_generations=task.num_generations,
        max_completion_length=task.max_completion_length,
        temperature=1.0,
        learning_rate=task.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        seed=seed,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def run_settings(task: Task, arm_name: str, seed: int) -> dict:
    """What a run of `task`, `arm_name` and `seed` records as its settings (the task's fields, the arm, the trainer's
    class and the config it sets), as its saved JSON holds them."""
    arm = ARMS[arm_name]
    kwargs = _config_kwargs(task, seed, "")
    settings = {
        "task": {
            f.name: getattr(task, f.name) for f in dataclasses.fields(task) if not callable(getattr(task, f.name))
        },
        "arm": dataclasses.asdict(arm),
        "trainer": "GRPOTrainer" if arm.exgrpo is None else "ExGRPOTrainer",
        "config": {k: v for k, v in kwargs.items() if k not in ("output_dir", "report_to", "disable_tqdm")},
    }
    return json.loads(json.dumps(settings))


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), digits)


def _evaluation(task: Task, model, tokenizer, dataset, seed: int) -> dict:
    return _summary(task.evaluate(model, tokenizer, dataset, task.eval_samples, seed))


def _summary(result: dict) -> dict:
    """An evaluation's overall and per-difficulty pass@1, rounded as records keep them."""
    return {
        "overall": _r(result["overall"]),
        "by_difficulty": {str(k): _r(v) for k, v in sorted(result["by_difficulty"].items())},
    }


def _rows_by_key(dataset) -> dict[str, dict]:
    from exgrpo_trl.buffer import question_key

    return {question_key(row["prompt"]): row for row in dataset}


STUDY_STATE = "study_state.json"  # the recorder's state beside a run's checkpoint, written after the trainer's save


def checkpoint_every(task: Task) -> int:
    """A run checkpoints at updates that end a generation batch and are evaluation steps (their curve point is in)."""
    return math.lcm(task.eval_every, task.steps_per_generation)


def _resume_point(output_dir: str, settings: dict) -> tuple[str | None, dict | None]:
    """The newest checkpoint of `output_dir` that is complete and holds a study state for these `settings`, and that
    state; the checkpoints newer than it (cut short) are deleted, and everything there when none qualifies (a run of
    other settings left it)."""
    from exgrpo_trl.checkpoints import checkpoint_problems, checkpoint_step

    root = Path(output_dir)
    found = sorted(
        (
            (step, path)
            for path in (root.iterdir() if root.is_dir() else [])
            if (step := checkpoint_step(path.name)) is not None
        ),
        reverse=True,
    )
    for step, path in found:
        try:
            state = json.loads((path / STUDY_STATE).read_text())
        except (OSError, ValueError):
            state = None
        if state is not None and state.get("settings") == settings and not checkpoint_problems(path):
            for newer_step, newer in found:
                if newer_step > step:
                    shutil.rmtree(newer, ignore_errors=True)
            return str(path), state
    shutil.rmtree(root, ignore_errors=True)
    return None, None


def progress_path(cache_dir: str | Path, task: str, arm: str, seed: int) -> Path:
    """Where a run in progress writes ``STEP MAX_STEPS`` after each step, for the parent's progress bars."""
    return Path(cache_dir) / "study-logs" / f"{task}-{arm}-seed{seed}.progress"


def run_one(
    task: Task,
    arm_name: str,
    seed: int,
    out_path: Path | None,
    cache_dir: str,
    workdir: str,
    *,
    confirmatory: bool = False,
    stop_after: int | None = None,
) -> dict:
    """Train one arm of one task with one seed, and save its JSON (atomically) to `out_path`.

    `confirmatory`: a registered run (`lab.study.confirm`): refused from a tree with uncommitted changes to tracked
    files, and a resume from a checkpoint another commit wrote is refused too. `stop_after`: train only the first
    `stop_after` updates from scratch (no resume) and return what was recorded up to there, saving nothing: what
    `lab.study.verify` compares with a saved run; at the run's length (`task.steps`) or more the whole run, its
    final evaluations and probes included, is returned and nothing saved (no JSON, final model or progress file)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from exgrpo_trl.checkpoints import CHECKPOINT_PREFIX, checkpoint_step

    from .provenance import LAB_ROOT, provenance, require_clean

    if confirmatory:
        require_clean(LAB_ROOT)  # at once, before minutes of loading
    arm = ARMS[arm_name]
    torch.set_num_threads(1)
    start = time.perf_counter()
    model, tokenizer = task.load(cache_dir, task.warm_start_steps, False)
    warm = copy.deepcopy(model)
    train_set, eval_set = task.splits(task.train_questions, task.eval_questions, cache_dir)
    kwargs = _config_kwargs(task, seed, os.path.join(workdir, f"{task.name}-{arm_name}-seed{seed}"))
    if arm.exgrpo is None:
        from trl import GRPOConfig, GRPOTrainer

        config, trainer_cls = GRPOConfig(**kwargs), GRPOTrainer
    else:
        from exgrpo_trl.config import ExGRPOConfig
        from exgrpo_trl.trainer import ExGRPOTrainer

        # checkpoints are how a killed run resumes; they change nothing in training, so the record leaves them out
        saves = dict(save_strategy="steps", save_steps=checkpoint_every(task), save_total_limit=2)
        config, trainer_cls = ExGRPOConfig(**{**kwargs, **saves}, **arm_settings(task, arm)), ExGRPOTrainer
    settings = run_settings(task, arm_name, seed)
    made_by = provenance(
        LAB_ROOT, config=config, warm_start=warm, train_set=train_set, eval_set=eval_set, confirmatory=confirmatory
    )
    resume, saved = (None, None)
    if arm.exgrpo is not None and stop_after is None:
        resume, saved = _resume_point(kwargs["output_dir"], settings)
    if saved is not None and saved.get("provenance", {}).get("commit") != made_by["commit"]:
        if confirmatory:  # one registered run, one commit
            raise RuntimeError(
                f"{resume} was written by commit {saved.get('provenance', {}).get('commit')}, this tree is at "
                f"{made_by['commit']}: resume a registered run from the commit that started it"
            )
        made_by["resumed_from_commit"] = saved.get("provenance", {}).get("commit")
    seen: Counter = Counter()  # training question -> rollouts scored (fresh and replayed rows alike)
    solved: Counter = Counter()  # training question -> successful rollouts among them

    groups_now: dict[str, float] = {}  # the zero-variance shares of the generation batch being scored

    @functools.wraps(task.reward)
    def reward(prompts, completions, **columns):
        rewards = task.reward(prompts=prompts, completions=completions, **columns)
        for prompt, r in zip(prompts, rewards):
            seen[prompt] += 1
            solved[prompt] += r is not None and r >= 1.0
        plan = run.last_plan if run is not None else None  # set before this batch was generated
        groups_now.clear()
        groups_now.update(
            group_shares(
                rewards,
                task.num_generations,
                len(plan.keys) if plan is not None else 0,
                stored_first=plan is not None and plan.with_trajectories,
            )
        )
        return rewards

    trainer = trainer_cls(
        model=model, reward_funcs=[reward], args=config, train_dataset=train_set, processing_class=tokenizer
    )
    # ExGRPOTrainer's cycle and state (None for GRPOTrainer)
    run, exgrpo = getattr(trainer, "exgrpo_run", None), getattr(trainer, "exgrpo_state", None)
    k, groups, spg = task.num_generations, task.generation_questions, task.steps_per_generation
    progress = progress_path(cache_dir, task.name, arm_name, seed) if stop_after is None else None
    # One entry per optimizer step; a generation batch is drawn at the first update of each `spg`, and its figures
    # (questions, replays, rollouts) are logged at that step, zeros at the others.
    steps_log: dict[str, list] = {
        "rollouts": [], "fresh_questions": [], "replayed": [], "replayed_difficulty": [],
        "batch_pass_at_1": [], "buffer_questions": [], "retired": [],
    }  # fmt: skip
    curve: dict[str, Any] = {"step": [], "rollouts": [], "pass_at_1": [], "by_difficulty": {}}
    # One entry per generation batch (`batch_record`): zero-variance groups among fresh and replayed groups, bucket
    # occupancy, the replayed trajectories' age and the importance weights of their tokens.
    batches: list[dict] = []
    weights: list = []  # the replayed tokens' importance weights of the generation batch being trained on
    replay_counts: Counter = Counter()
    resumed_at: list[int] = []  # the updates a killed run resumed from
    if saved is not None:  # a killed run: everything recorded up to its checkpoint
        steps_log.update(saved["steps"])
        curve.update(saved["curve"])
        batches.extend(saved.get("batches", []))
        for counter, name in ((seen, "seen"), (solved, "solved"), (replay_counts, "replay_counts")):
            counter.update(saved[name])
        start -= saved["seconds"]
        resumed_at = [*saved["resumed_at"], checkpoint_step(Path(resume).name)]

    def evaluate_now(step: int, rollouts: int) -> None:
        result = _evaluation(task, trainer.model, tokenizer, eval_set, seed)
        curve["step"].append(step)
        curve["rollouts"].append(rollouts)
        curve["pass_at_1"].append(result["overall"])
        for d, v in result["by_difficulty"].items():
            curve["by_difficulty"].setdefault(d, []).append(v)

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            generated_now = (state.global_step - 1) % spg == 0  # TRL generates every spg optimizer steps
            plan = run.last_plan if run is not None and generated_now else None
            replayed = len(plan.keys) if plan is not None else 0
            offline = exgrpo.offline.last_rows if exgrpo is not None and generated_now else 0  # not generated
            generated = groups * k - (replayed if plan is not None and plan.with_trajectories else 0) - offline
            generated = generated if generated_now else 0
            total = (steps_log["rollouts"][-1] if steps_log["rollouts"] else 0) + generated
            steps_log["rollouts"].append(total)
            steps_log["fresh_questions"].append(groups - replayed if generated_now else 0)
            steps_log["replayed"].append(replayed)
            steps_log["replayed_difficulty"].append([row.get(task.difficulty) for row in plan.rows] if plan else [])
            replay_counts.update(plan.keys if plan is not None else [])
            last = state.log_history[-1] if state.log_history else {}
            steps_log["batch_pass_at_1"].append(_r(last.get("reward")))
            buffer = exgrpo.buffer if exgrpo is not None else None
            steps_log["buffer_questions"].append(buffer.num_questions if buffer is not None else None)
            steps_log["retired"].append(len(buffer.retired) if buffer is not None else None)
            if generated_now:
                batches.append(batch_record(state.global_step - 1, plan, groups_now, buffer, spg))
                if exgrpo is not None and exgrpo.offline.active:  # offline guidance: its rows in this batch
                    batches[-1]["offline_rows"] = offline
            logged = run.replay_token_weights if run is not None else None  # a list from the start
            if logged:
                weights.extend(logged)
                logged.clear()
            if state.global_step % spg == 0 and batches:  # the generation batch's last update: its weights are in
                batches[-1]["is_weight"] = weight_summary(weights, getattr(trainer.args, "policy_shaping_gamma", None))
                weights.clear()
            if state.global_step % task.eval_every == 0 or state.global_step == state.max_steps:
                evaluate_now(state.global_step, total)
            if progress is not None:
                _write_atomic(progress, f"{state.global_step} {state.max_steps}\n")
            if stop_after is not None and state.global_step >= stop_after:
                control.should_training_stop = True

        def on_save(self, args, state, control, **kw):  # after the trainer's own save: its checkpoint is complete
            checkpoint = Path(args.output_dir) / f"{CHECKPOINT_PREFIX}{state.global_step}"
            if checkpoint.is_dir():
                recorded = {"settings": settings, "seconds": round(time.perf_counter() - start, 1), "steps": steps_log,
                            "curve": curve, "seen": seen, "solved": solved, "replay_counts": replay_counts,
                            "resumed_at": resumed_at, "batches": batches, "provenance": made_by}  # fmt: skip
                _write_atomic(checkpoint / STUDY_STATE, json.dumps(recorded))

    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(Recorder())
    if run is not None:  # ExGRPOTrainer: keep the replayed tokens' weights for the record
        run.replay_token_weights = []
    if resume is None:
        evaluate_now(0, 0)
    trainer.train(resume_from_checkpoint=resume)
    if stop_after is not None and stop_after < task.steps:  # a verification: what was recorded up to there
        shutil.rmtree(kwargs["output_dir"], ignore_errors=True)
        return {"task": task.name, "arm": arm_name, "seed": seed, "settings": settings, "provenance": made_by,
                "curve": curve, "steps": steps_log, "batches": batches}  # fmt: skip

    # End-of-run probes on training questions: the most replayed ones and the retired ones, warm start vs final.
    rows = _rows_by_key(train_set)
    probes, evaluated = {}, {}  # evaluated: name -> the warm start's and the final model's evaluations (per question)
    buffer = exgrpo.buffer if exgrpo is not None else None
    candidates = {
        "replayed": [key for key, _ in replay_counts.most_common(PROBE_QUESTIONS)],
        "retired": sorted(buffer.retired)[:PROBE_QUESTIONS] if buffer is not None else [],
    }
    for name, keys in candidates.items():
        keys = [key for key in keys if key in rows]
        if not keys:
            continue
        probe_set = Dataset.from_list([rows[key] for key in keys])
        models = (warm, trainer.model)
        evaluated[name] = [task.evaluate(m, tokenizer, probe_set, task.eval_samples, seed) for m in models]
        probes[name] = {
            "questions": len(keys),
            "warm_start": _summary(evaluated[name][0]),
            "final": _summary(evaluated[name][1]),
        }
    control = overfitting_control(
        task, warm, trainer.model, tokenizer, train_set, replay_counts, seed, evaluated.get("replayed")
    )
    if stop_after is None:  # not a verification
        save_final_model(trainer.model, final_model_path(cache_dir, task.name, arm_name, seed))
    histogram = Counter(replay_counts.values())
    # The held-out estimate's own noise: the final model evaluated again with other sampling seeds.
    resampled = [
        _evaluation(task, trainer.model, tokenizer, eval_set, 1000 + seed * 100 + j)["overall"]
        for j in range(1, task.final_eval_seeds)
    ]
    record = {
        "task": task.name,
        "arm": arm_name,
        "seed": seed,
        "settings": settings,
        "provenance": made_by,
        "seconds": round(time.perf_counter() - start, 1),
        "resumed_at": resumed_at,
        "curve": curve,
        "steps": steps_log,
        "batches": batches,
        "replay_counts": {
            "questions_replayed": len(replay_counts),
            "replays": sum(replay_counts.values()),
            "max": max(replay_counts.values(), default=0),
            "histogram": {str(c): n for c, n in sorted(histogram.items())},
        },
        "probes": probes,
        "control": control,
        "questions": {
            "pool": len(train_set),
            "seen": len(seen),
            "never_solved": sum(1 for prompt in seen if solved[prompt] == 0),
            "fresh_visits": sum(steps_log["fresh_questions"]),
        },
        "final": {
            "pass_at_1": curve["pass_at_1"][-1],
            "by_difficulty": {d: v[-1] for d, v in curve["by_difficulty"].items()},
            "rollouts": steps_log["rollouts"][-1],
            "pass_at_1_resampled": [curve["pass_at_1"][-1], *resampled],
        },
    }
    if out_path is not None:
        _write_atomic(out_path, json.dumps(record, separators=(",", ":")) + "\n")
    shutil.rmtree(kwargs["output_dir"], ignore_errors=True)  # the run's checkpoints: the record is saved
    return record


CONTROL_CANDIDATES = 800  # never-replayed training questions scored at the warm start, to match the replayed ones from


def final_model_path(cache_dir: str | Path, task: str, arm: str, seed: int) -> Path:
    """Where a run keeps its final model (safetensors, about 4 MB) for the over-fitting control (`study.control`)."""
    return Path(cache_dir) / "final-models" / f"{task}-{arm}-seed{seed}"


def save_final_model(model, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def matched_questions(replayed: list[tuple[str, Any, float]], candidates: list[tuple[str, Any, float]]) -> list[str]:
    """For each replayed question (key, difficulty, warm-start pass rate), in order, the unused candidate of the same
    difficulty whose warm-start pass rate is nearest (ties: the earlier candidate); a replayed question with no
    candidate of its difficulty left gets none."""
    used: set[str] = set()
    out = []
    for _, difficulty, rate in replayed:
        best = None
        for key, d, r in candidates:
            if d != difficulty or key in used:
                continue
            if best is None or abs(r - rate) < abs(best[2] - rate):
                best = (key, d, r)
        if best is not None:
            used.add(best[0])
            out.append(best[0])
    return out


def overfitting_control(
    task: Task, warm, final, tokenizer, train_set, replay_counts: Counter, seed: int, replayed: list | None
) -> dict | None:
    """The run's `PROBE_QUESTIONS` most replayed training questions, and as many never-replayed ones matched to them
    by difficulty and warm-start pass rate (from `CONTROL_CANDIDATES` drawn with the run's seed): their keys and the
    warm start's and this run's final pass@1 on each set. Another run's final model (GRPO's, same seed) is scored on
    the same two sets by `lab.study.control`: a rise on the replayed set that the matched set or GRPO shows too is not
    replay's doing. `replayed`: the warm start's and the final model's evaluations of the most replayed questions,
    as the end-of-run probe made them (not made twice). None when nothing was replayed."""
    import random

    from datasets import Dataset

    if not replay_counts or replayed is None:
        return None
    rows = _rows_by_key(train_set)
    top = [key for key, _ in replay_counts.most_common(PROBE_QUESTIONS) if key in rows]
    never = sorted(key for key in rows if key not in replay_counts)
    pool = random.Random(seed).sample(never, min(CONTROL_CANDIDATES, len(never)))

    def rates(model, keys):
        return task.evaluate(model, tokenizer, Dataset.from_list([rows[k] for k in keys]), task.eval_samples, seed)

    warm_on_top, final_on_top = replayed
    warm_top, warm_pool = warm_on_top["per_question"], rates(warm, pool)["per_question"]
    diff = task.difficulty
    matched = matched_questions(
        [(k, rows[k].get(diff), r) for k, r in zip(top, warm_top)],
        [(k, rows[k].get(diff), r) for k, r in zip(pool, warm_pool)],
    )
    warm_by_key = dict(zip(pool, warm_pool))
    return {
        "replayed": top,
        "matched": matched,
        "warm_start": {"replayed": _r(statistics.fmean(warm_top)),
                       "matched": _r(statistics.fmean(warm_by_key[k] for k in matched)) if matched else None},
        "final": {"replayed": _r(final_on_top["overall"]),
                  "matched": _r(rates(final, matched)["overall"]) if matched else None},
    }  # fmt: skip


def group_shares(rewards: list, k: int, replayed: int, stored_first: bool = True) -> dict[str, float]:
    """Counts of groups of `k` consecutive rows with no success (all-fail) and with every row a success (all-pass),
    among the fresh groups and among the last `replayed` groups (a replay plan's), whose advantages are all zero.
    A row succeeds with a reward >= 1 (the toy tasks' rewards are 0 or 1, so these are the zero-variance groups).
    `replayed_fresh_all_fail`: replayed groups whose generated rows all fail (the K - 1 after the stored first row
    when `stored_first`, else all K): the stored success is then the group's only positive advantage."""
    solved = [r is not None and r >= 1.0 for r in rewards]
    groups = [sum(solved[g * k : (g + 1) * k]) for g in range(len(solved) // k)]
    split = len(groups) - replayed
    out = {}
    for name, part in (("fresh", groups[:split]), ("replayed", groups[split:])):
        out[f"{name}_groups"] = len(part)
        out[f"{name}_all_fail"] = sum(1 for c in part if c == 0)
        out[f"{name}_all_pass"] = sum(1 for c in part if c == k)
    skip = 1 if stored_first else 0
    out["replayed_fresh_all_fail"] = sum(
        1 for g in range(split, len(groups)) if not any(solved[g * k + skip : (g + 1) * k])
    )
    return out


def batch_record(step: int, plan, groups: dict, buffer, updates_per_batch: int = 1) -> dict:
    """What one generation batch, generated at update `step` (0-based), was made of: its fresh and replayed groups
    (`group_shares`), the bucket occupancy of the buffer the batch drew from (questions per k = 1..K-1; its outcome
    is committed after the batch's first pass, so not yet), the age in updates of each replayed stored trajectory
    (generation batches since it was collected, times `updates_per_batch`), the bucket (success count k) of each
    replayed question when it was drawn, the share of them also replayed in the generation batch before
    (`repeat_share`), and replays per distinct replayed question over the last 50 generation batches (`reuse`: the
    trainer's `exgrpo/replay/reuse`)."""
    with_ages = plan is not None and plan.with_trajectories
    ages = [(plan.clock - c) * updates_per_batch for c in plan.collected_at] if with_ages else []
    return {
        "step": step,
        **groups,
        "buckets": {str(b): n for b, n in buffer.bucket_counts().items()} if buffer is not None else None,
        "age": {"mean": _r(statistics.mean(ages), 2), "max": max(ages)} if ages else None,
        "replayed_buckets": list(plan.buckets) if plan is not None else [],
        "repeat_share": _r(plan.repeat_share) if plan is not None else None,
        "reuse": _r(buffer.reuse()) if buffer is not None else None,
    }


def weight_summary(weights: list, gamma: float | None) -> dict | None:
    """The importance weights w of one generation batch's replayed tokens (over both of its updates): mean, 5th and
    95th percentile, and the share below `gamma` (where the shaping f(w) = w / (w + gamma) is under 1/2)."""
    import torch

    if not weights or sum(t.numel() for t in weights) == 0:
        return None
    w = torch.cat([t.double().flatten() for t in weights])
    q = torch.quantile(w, torch.tensor([0.05, 0.95], dtype=torch.float64)).tolist()
    below = None if gamma is None else float((w < gamma).double().mean())
    return {
        "tokens": w.numel(),
        "mean": _r(float(w.mean())),
        "p05": _r(q[0]),
        "p95": _r(q[1]),
        "below_gamma": _r(below),
    }


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
