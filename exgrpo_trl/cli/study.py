"""`exgrpo study`: what ExGRPO buys over GRPO on the toy tasks, measured over seeds.

    exgrpo study --tasks addition --arms grpo,exgrpo --seeds 0-4     # train what is missing, then report
    exgrpo study --report-only                                        # the table and figure from the saved runs

A run is one (task, arm, seed): it trains from the task's cached supervised warm start with TRL's `GRPOTrainer` or
`ExGRPOTrainer` (public API and config switches only), evaluates held-out pass@1 every `eval_every` steps, and saves
one small JSON (settings, curves, per-step logs, final figures) as ``RESULTS/<task>/<arm>/seed<k>.json``. A run whose
JSON exists is skipped, so an interrupted study resumes where it stopped, here or on another machine. A run of
`ExGRPOTrainer` (every arm but `grpo`) also checkpoints every `checkpoint_every(task)` updates into the cache and a
killed one resumes from its newest complete checkpoint, with the same result as a run never stopped; a `grpo` run
(TRL's `GRPOTrainer`, whose sampler resumed in a later epoch draws the first epoch's order again) restarts. Runs train
`--jobs` at a time (default 2), each in its own process with one torch thread. Then ``RESULTS/results.json``,
``results.md`` and ``study.png`` are written: held-out pass@1 against generated rollouts, median and min-max band
over seeds, overall and per difficulty.

Generated rollouts count K per fresh group and K - 1 per replayed group (the stored trajectory is not generated;
`replay_stored_trajectory=False` revisits generate all K). The issue's target: ExGRPO reaches GRPO's final held-out
pass@1 (median over seeds) with at most 70% of GRPO's generated rollouts.

Per-step logs of each run, for the diagnosis: fresh and replayed questions per step, the difficulty of each replayed
question, batch pass@1, buffer and retired-set sizes; how often each question was replayed; and, at the end, the
warm start's and the final model's pass@1 on the most-replayed training questions and on retired questions (rising
on replayed questions while held-out falls is overfitting; falling on retired ones is forgetting).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_RESULTS = "benchmarks/results/study"
DEFAULT_CACHE = ".cache/exgrpo-demo"
TARGET_ROLLOUT_SHARE = 0.70
# The toy tasks' model: Qwen2-shaped, ~1.05M parameters, four heads of 32 (with two heads of 64 the supervised
# warm start stalls on multi-digit sums for longer).
TOY_MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512)
PROBE_QUESTIONS = 100  # questions per end-of-run probe (most replayed, retired)


# ------------------------------------------------------------------------------------------------ tasks
@dataclass(frozen=True)
class Task:
    """A toy task with everything a run needs; the RL settings are fixed per task, the same for every arm."""

    name: str
    description: str
    load: Callable[..., Any]  # (cache_dir, warm_start_steps, progress) -> (model, tokenizer), cached
    splits: Callable[..., Any]  # (n_train, n_eval, cache_dir) -> (train Dataset, eval Dataset)
    reward: Callable[..., list[float]]
    evaluate: Callable[..., dict]  # (model, tokenizer, dataset, samples, seed) -> overall, by_difficulty, per_q
    difficulty: str  # dataset column holding the difficulty
    warm_start_steps: int
    learning_rate: float
    steps: int
    max_completion_length: int
    prompts_per_step: int = 16  # questions per optimizer update
    steps_per_generation: int = 1  # optimizer updates per generation batch (the paper: 2, 128 questions in 2 x 64)
    num_generations: int = 8
    train_questions: int = 2000
    eval_questions: int = 200
    eval_samples: int = 8
    eval_every: int = 25
    exgrpo: dict = field(default_factory=dict)  # ExGRPO settings of the task (e.g. a weak start replays at once)
    final_eval_seeds: int = 1  # the final model evaluated again on this many sampling seeds (the estimate's noise)

    @property
    def step_size(self) -> float:
        """Learning rate per question of an optimizer update: how far one question moves the model."""
        return self.learning_rate / self.prompts_per_step

    @property
    def generation_questions(self) -> int:
        return self.prompts_per_step * self.steps_per_generation


def _addition_load(cache_dir, warm_start_steps, progress):
    from ..tasks.toy import load_or_train_warm_start

    return load_or_train_warm_start(cache_dir, steps=warm_start_steps, seed=0, progress=progress, **TOY_MODEL)


def _addition_splits(n_train, n_eval, cache_dir=None):
    from ..tasks.toy import addition_splits

    return addition_splits(n_train, n_eval, seed=0)


def _addition_reward(completions, answer, **kwargs):
    from ..tasks.toy import addition_reward

    return addition_reward(completions, answer, **kwargs)


def _addition_evaluate(model, tokenizer, dataset, samples, seed):
    from ..tasks.toy import evaluate_pass_at_1

    result = evaluate_pass_at_1(model, tokenizer, dataset, samples=samples, seed=seed, progress=False)
    return {"overall": result["overall"], "by_difficulty": result["by_digits"], "per_question": result["per_question"]}


def _countdown_load(cache_dir, warm_start_steps, progress):
    from ..tasks.countdown import countdown_warm_start

    return countdown_warm_start(cache_dir, warm_start_steps, seed=0, progress=progress)


def _countdown_splits(n_train, n_eval, cache_dir=None):
    from ..tasks.countdown import countdown_splits

    return countdown_splits(n_train, n_eval, seed=0)


def _countdown_pool_splits(n_train, n_eval, cache_dir=None):
    from ..tasks.countdown import countdown_pool_splits

    return countdown_pool_splits(n_train, n_eval, cache_dir=cache_dir, seed=0)


def _countdown_reward(completions, numbers, target, **kwargs):
    from ..tasks.countdown import countdown_reward

    return countdown_reward(completions, numbers, target, **kwargs)


def _countdown_evaluate(model, tokenizer, dataset, samples, seed):
    from ..tasks.countdown import evaluate_countdown

    result = evaluate_countdown(model, tokenizer, dataset, samples=samples, seed=seed, progress=False)
    return {
        "overall": result["overall"],
        "by_difficulty": result["by_difficulty"],
        "per_question": result["per_question"],
    }


def _countdown(start: str, warm_start_steps: int, description: str, **exgrpo) -> Task:
    return Task(
        name=f"countdown-{start}",
        description=description,
        load=_countdown_load,
        splits=_countdown_splits,
        reward=_countdown_reward,
        evaluate=_countdown_evaluate,
        difficulty="difficulty",
        warm_start_steps=warm_start_steps,
        # Chosen on GRPO alone (countdown-medium, seed 100, not a study seed; benchmarks/results/study_lr): held-out
        # pass@1 after 400 steps 0.496 / 0.503 / 0.464 / 0.437 at lr 2.5e-5 / 5e-5 / 1e-4 / 2e-4 (warm start 0.389);
        # at 5e-5 GRPO reaches 0.49 by step 175 and 0.50 by 400. Frozen for every arm and both starts.
        learning_rate=5e-5,
        steps=400,
        max_completion_length=16,
        exgrpo=exgrpo,
    )


TASKS: dict[str, Task] = {
    "addition": Task(
        name="addition",
        description="1-4 digit addition, one correct answer string per question",
        load=_addition_load,
        splits=_addition_splits,
        reward=_addition_reward,
        evaluate=_addition_evaluate,
        difficulty="digits",
        warm_start_steps=1500,
        learning_rate=1e-4,
        steps=300,
        max_completion_length=8,
        eval_samples=16,
    ),
    # Countdown (exgrpo_trl.tasks.countdown): many correct expressions per question. Held-out questions are a fixed
    # quarter the warm start never saw; difficulty = the fewest numbers a solution needs (2-4).
    "countdown-medium": _countdown(
        "medium", 2000, "Countdown from a medium start (warm-start held-out pass@1 about 0.40)"
    ),
    "countdown-weak": _countdown(
        "weak",
        200,
        "Countdown from a weak start (about 0.09): the paper's weak-model regime, replay from the first step",
        replay_start_pass_rate=0.0,
    ),
}


# The paper-shaped setting and the step-size sweep: Countdown in the paper's batch shape (a generation batch of 128
# questions x 8 rollouts, two optimizer updates of 64 questions), over nearly the whole train pool so that ExGRPO
# draws each training question fresh about once, with the delayed start at the paper's 0.35. Its points differ only
# in the learning rate, so lr / questions per update (the step one question moves the model) runs from the earlier
# settings' 3.1e-6 down; the smallest is the paper-shaped point.
SWEEP_FAMILY = "countdown-paper"
PAPER_SHAPE = dict(
    prompts_per_step=64,
    steps_per_generation=2,
    train_questions=16000,
    eval_questions=1000,
    eval_every=25,
    final_eval_seeds=4,
)
# The warm start, measured on 2,000 questions of the 16,000-question pool (8 samples each at temperature 1): after
# 600 / 1,000 / 2,000 supervised steps pass@1 0.13 / 0.17 / 0.25, with 50% / 43% / 32% of questions solved by none of
# the 8 samples. At 2,000 a GRPO training batch starts at a pass@1 of about 0.30 and crosses the delayed start's 0.35
# after 28-80 updates (calibration runs, by learning rate), so replay switches on the paper's way; weaker starts,
# with more never-solved questions as in the paper, would not reach 0.35 at the smaller learning rates in 600 updates.
SWEEP_WARM_START = 2000
# Learning rate -> optimizer updates, chosen on GRPO alone (seed 100, not a study seed; benchmarks/results/
# study_calibration, 600 updates each, held-out pass@1 from 0.235) so that GRPO is still improving over the last
# quarter: at 2e-4 GRPO climbs to 0.337 by update 100 and then wanders between 0.33 and 0.38 (100 updates: +0.008 over
# the last quarter); at 1e-4 it reaches 0.421 at 400 and stays there (400: +0.031); at 5e-5 and 2.5e-5 it still rises
# at 600 (+0.031 and +0.019). 2.5e-5 is the paper-shaped point; 1.25e-5 the smallest step the CPU allows in 600.
SWEEP_POINTS = {
    "2e-4": 100,
    "1e-4": 400,
    "5e-5": 600,
    "2.5e-5": 600,
    "1.25e-5": 600,
}
PAPER_POINT = f"{SWEEP_FAMILY}-lr2.5e-5"


def _sweep_point(lr: str, steps: int) -> Task:
    return Task(
        name=f"{SWEEP_FAMILY}-lr{lr}",
        description=f"Countdown, the paper's batch shape and delayed start, lr {lr} ({float(lr) / 64:.1e} a question)",
        load=_countdown_load,
        splits=_countdown_pool_splits,
        reward=_countdown_reward,
        evaluate=_countdown_evaluate,
        difficulty="difficulty",
        warm_start_steps=SWEEP_WARM_START,
        learning_rate=float(lr),
        steps=steps,
        max_completion_length=16,
        exgrpo={"replay_start_pass_rate": 0.35},
        **PAPER_SHAPE,
    )


TASKS.update({f"{SWEEP_FAMILY}-lr{lr}": _sweep_point(lr, steps) for lr, steps in SWEEP_POINTS.items()})

# The difficulty axis at the paper-shaped step: the same batch shape, pool, held-out set, lr and length as the
# paper-shaped point, from a weaker warm start, so that about half of the training questions a GRPO run draws are
# never solved by it; replay from the first step, the paper's weak-model (Llama-3.1-8B) setting. How the warm start
# was chosen: docs/study.md, "The hard point".
HARD_POINT = "countdown-hard"
HARD_WARM_START = 600


def _difficulty_point(name: str, warm_start_steps: int, description: str) -> Task:
    return dataclasses.replace(
        TASKS[PAPER_POINT],
        name=name,
        description=description,
        warm_start_steps=warm_start_steps,
        exgrpo={"replay_start_pass_rate": 0.0},
    )


TASKS[HARD_POINT] = _difficulty_point(
    HARD_POINT,
    HARD_WARM_START,
    f"Countdown, the paper's batch shape and step (lr 2.5e-5), a weak warm start ({HARD_WARM_START} steps): about "
    "half the training questions never solved; replay from the first step",
)


@dataclass(frozen=True)
class Arm:
    description: str
    exgrpo: dict | None  # ExGRPOConfig fields on top of the paper's defaults; None: TRL's GRPOTrainer


_PAPER = {"max_trajectory_candidates": None}  # the paper scores every stored trajectory
ARMS: dict[str, Arm] = {
    "grpo": Arm("GRPO (TRL GRPOTrainer)", None),
    "exgrpo": Arm("ExGRPO, the paper's settings", dict(_PAPER)),
    "uniform_questions": Arm("ablation: uniform question selection", {**_PAPER, "question_selection": "uniform"}),
    "random_trajectory": Arm("ablation: random trajectory selection", {**_PAPER, "trajectory_selection": "random"}),
    "no_shaping": Arm("ablation: no policy shaping (plain ratio)", {**_PAPER, "policy_shaping_gamma": None}),
    "keep_retired": Arm("ablation: retired questions not skipped", {**_PAPER, "skip_retired_questions": False}),
    "revisit_no_replay": Arm(
        "diagnostic: replay's questions, K fresh rollouts, no stored trajectory",
        {**_PAPER, "replay_stored_trajectory": False},
    ),
    "grpo_skip_retired": Arm(
        "diagnostic: GRPO with retired questions skipped",
        {"replay_ratio": 0.0, "skip_retired_without_replay": True},
    ),
}
MAIN_ARMS = ("grpo", "exgrpo")


# ------------------------------------------------------------------------------------------------ one run
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


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), digits)


def _evaluation(task: Task, model, tokenizer, dataset, seed: int) -> dict:
    result = task.evaluate(model, tokenizer, dataset, task.eval_samples, seed)
    return {
        "overall": _r(result["overall"]),
        "by_difficulty": {str(k): _r(v) for k, v in sorted(result["by_difficulty"].items())},
    }


def _rows_by_key(dataset) -> dict[str, dict]:
    from ..buffer import question_key

    return {question_key(row["prompt"]): row for row in dataset}


STUDY_STATE = "study_state.json"  # the recorder's state beside a run's checkpoint, written after the trainer's save


def checkpoint_every(task: Task) -> int:
    """A run checkpoints at updates that end a generation batch and are evaluation steps (their curve point is in)."""
    return math.lcm(task.eval_every, task.steps_per_generation)


def _resume_point(output_dir: str, settings: dict) -> tuple[str | None, dict | None]:
    """The newest checkpoint of `output_dir` that is complete and holds a study state for these `settings`, and that
    state; the checkpoints newer than it (cut short) are deleted, and everything there when none qualifies (a run of
    other settings left it)."""
    from ..checkpoints import checkpoint_problems, checkpoint_step

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


def run_one(task: Task, arm_name: str, seed: int, out_path: Path, cache_dir: str, workdir: str) -> dict:
    """Train one arm of one task with one seed, and save its JSON (atomically) to `out_path`."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from ..checkpoints import CHECKPOINT_PREFIX, checkpoint_step

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
        from ..config import ExGRPOConfig
        from ..trainer import ExGRPOTrainer

        # checkpoints are how a killed run resumes; they change nothing in training, so the record leaves them out
        saves = dict(save_strategy="steps", save_steps=checkpoint_every(task), save_total_limit=2)
        config, trainer_cls = ExGRPOConfig(**{**kwargs, **saves}, **{**task.exgrpo, **arm.exgrpo}), ExGRPOTrainer
    settings = {
        "task": {
            f.name: getattr(task, f.name) for f in dataclasses.fields(task) if not callable(getattr(task, f.name))
        },
        "arm": dataclasses.asdict(arm),
        "trainer": trainer_cls.__name__,
        "config": {k: v for k, v in kwargs.items() if k not in ("output_dir", "report_to", "disable_tqdm")},
    }
    settings = json.loads(json.dumps(settings))  # as a saved state holds it
    resume, saved = _resume_point(kwargs["output_dir"], settings) if arm.exgrpo is not None else (None, None)
    seen: Counter = Counter()  # training question -> rollouts scored (fresh and replayed rows alike)
    solved: Counter = Counter()  # training question -> successful rollouts among them

    groups_now: dict[str, float] = {}  # the zero-variance shares of the generation batch being scored

    @functools.wraps(task.reward)
    def reward(prompts, completions, **columns):
        rewards = task.reward(prompts=prompts, completions=completions, **columns)
        for prompt, r in zip(prompts, rewards):
            seen[prompt] += 1
            solved[prompt] += r is not None and r >= 1.0
        plan = getattr(trainer, "last_replay_plan", None)  # set before this batch was generated
        groups_now.clear()
        groups_now.update(group_shares(rewards, task.num_generations, len(plan.keys) if plan is not None else 0))
        return rewards

    trainer = trainer_cls(
        model=model, reward_funcs=[reward], args=config, train_dataset=train_set, processing_class=tokenizer
    )
    k, groups, spg = task.num_generations, task.generation_questions, task.steps_per_generation
    progress = progress_path(cache_dir, task.name, arm_name, seed)
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
            plan = getattr(trainer, "last_replay_plan", None) if generated_now else None
            replayed = len(plan.keys) if plan is not None else 0
            generated = groups * k - (replayed if plan is not None and plan.with_trajectories else 0)
            generated = generated if generated_now else 0
            total = (steps_log["rollouts"][-1] if steps_log["rollouts"] else 0) + generated
            steps_log["rollouts"].append(total)
            steps_log["fresh_questions"].append(groups - replayed if generated_now else 0)
            steps_log["replayed"].append(replayed)
            steps_log["replayed_difficulty"].append([row.get(task.difficulty) for row in plan.rows] if plan else [])
            replay_counts.update(plan.keys if plan is not None else [])
            last = state.log_history[-1] if state.log_history else {}
            steps_log["batch_pass_at_1"].append(_r(last.get("reward")))
            buffer = getattr(trainer, "experience_buffer", None)
            steps_log["buffer_questions"].append(buffer.num_questions if buffer is not None else None)
            steps_log["retired"].append(len(buffer.retired) if buffer is not None else None)
            if generated_now:
                batches.append(batch_record(state.global_step - 1, plan, groups_now, buffer))
            logged = getattr(trainer, "replay_token_weights", None)  # ExGRPOTrainer's, a list from the start
            if logged:
                weights.extend(logged)
                logged.clear()
            if state.global_step % spg == 0 and batches:  # the generation batch's last update: its weights are in
                batches[-1]["is_weight"] = weight_summary(weights, getattr(trainer.args, "policy_shaping_gamma", None))
                weights.clear()
            if state.global_step % task.eval_every == 0 or state.global_step == state.max_steps:
                evaluate_now(state.global_step, total)
            _write_atomic(progress, f"{state.global_step} {state.max_steps}\n")

        def on_save(self, args, state, control, **kw):  # after the trainer's own save: its checkpoint is complete
            checkpoint = Path(args.output_dir) / f"{CHECKPOINT_PREFIX}{state.global_step}"
            if checkpoint.is_dir():
                recorded = {"settings": settings, "seconds": round(time.perf_counter() - start, 1), "steps": steps_log,
                            "curve": curve, "seen": seen, "solved": solved, "replay_counts": replay_counts,
                            "resumed_at": resumed_at, "batches": batches}  # fmt: skip
                _write_atomic(checkpoint / STUDY_STATE, json.dumps(recorded))

    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(Recorder())
    if hasattr(trainer, "replay_token_weights"):  # ExGRPOTrainer: keep the replayed tokens' weights for the record
        trainer.replay_token_weights = []
    if resume is None:
        evaluate_now(0, 0)
    trainer.train(resume_from_checkpoint=resume)

    # End-of-run probes on training questions: the most replayed ones and the retired ones, warm start vs final.
    rows = _rows_by_key(train_set)
    probes = {}
    buffer = getattr(trainer, "experience_buffer", None)
    candidates = {
        "replayed": [key for key, _ in replay_counts.most_common(PROBE_QUESTIONS)],
        "retired": sorted(buffer.retired)[:PROBE_QUESTIONS] if buffer is not None else [],
    }
    for name, keys in candidates.items():
        keys = [key for key in keys if key in rows]
        if not keys:
            continue
        probe_set = Dataset.from_list([rows[key] for key in keys])
        probes[name] = {
            "questions": len(keys),
            "warm_start": _evaluation(task, warm, tokenizer, probe_set, seed),
            "final": _evaluation(task, trainer.model, tokenizer, probe_set, seed),
        }
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
    _write_atomic(out_path, json.dumps(record, separators=(",", ":")) + "\n")
    shutil.rmtree(kwargs["output_dir"], ignore_errors=True)  # the run's checkpoints: the record is saved
    return record


def group_shares(rewards: list, k: int, replayed: int) -> dict[str, float]:
    """Counts of groups of `k` consecutive rows with no success (all-fail) and with every row a success (all-pass),
    among the fresh groups and among the last `replayed` groups (a replay plan's), whose advantages are all zero.
    A row succeeds with a reward >= 1 (the toy tasks' rewards are 0 or 1, so these are the zero-variance groups)."""
    solved = [r is not None and r >= 1.0 for r in rewards]
    groups = [sum(solved[g * k : (g + 1) * k]) for g in range(len(solved) // k)]
    split = len(groups) - replayed
    out = {}
    for name, part in (("fresh", groups[:split]), ("replayed", groups[split:])):
        out[f"{name}_groups"] = len(part)
        out[f"{name}_all_fail"] = sum(1 for c in part if c == 0)
        out[f"{name}_all_pass"] = sum(1 for c in part if c == k)
    return out


def batch_record(step: int, plan, groups: dict, buffer) -> dict:
    """What one generation batch, generated at update `step` (0-based), was made of: its fresh and replayed groups
    (`group_shares`), the buffer's bucket occupancy after the batch was committed (questions per k = 1..K-1), and
    the age in updates of each replayed stored trajectory (`step` minus the update it was collected at)."""
    ages = [step - c for c in plan.collected_at] if plan is not None and plan.with_trajectories else []
    return {
        "step": step,
        **groups,
        "buckets": {str(b): n for b, n in buffer.bucket_counts().items()} if buffer is not None else None,
        "age": {"mean": _r(statistics.mean(ages), 2), "max": max(ages)} if ages else None,
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


# ------------------------------------------------------------------------------------------------ the study
def run_path(results: Path, task: str, arm: str, seed: int) -> Path:
    return results / task / arm / f"seed{seed}.json"


def _parse_seeds(text: str) -> list[int]:
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    return seeds


def _child_command(args, task: str, arm: str, seed: int) -> list[str]:
    cmd = [sys.executable, "-m", "exgrpo_trl.cli", "study", "--run-one", task, arm, str(seed)]
    cmd += ["--results", str(args.results), "--cache-dir", str(args.cache_dir)]
    cmd += [part for item in args.set for part in ("--set", item)]
    return cmd + (["--quick"] if args.quick else [])


def _step(cache_dir, key: tuple[str, str, int]) -> tuple[int, int] | None:
    try:
        step, total = progress_path(cache_dir, *key).read_text().split()
        return int(step), int(total)
    except (OSError, ValueError):
        return None


def run_missing(
    args, tasks: dict[str, Task], todo: list[tuple[str, str, int]], step_bars: dict[tuple, str] | None = None
) -> list[str]:
    """Train the runs in `todo`, `args.jobs` at a time in child processes; returns the failures.

    Progress: one bar over runs, its postfix the step each running run is at; or, with `step_bars` (run -> label),
    one bar of steps per run instead."""
    import torch
    from tqdm.auto import tqdm

    from ..utils.threads import default_cpu_threads

    torch.set_num_threads(default_cpu_threads())  # the warm starts below; a busy machine slows 2 threads 5-17 times
    for task in sorted({t for t, _, _ in todo}):  # build each warm start and data split once, before the children
        tasks[task].load(str(args.cache_dir), tasks[task].warm_start_steps, not args.no_progress)
        tasks[task].splits(tasks[task].train_questions, tasks[task].eval_questions, str(args.cache_dir))
    logs = Path(args.cache_dir) / "study-logs"
    logs.mkdir(parents=True, exist_ok=True)
    pending, running, failures = list(todo), {}, []
    bar = tqdm(
        total=len(todo), desc="study runs", unit="run", disable=args.no_progress or bool(step_bars), dynamic_ncols=True
    )
    bars = {
        key: tqdm(total=tasks[key[0]].steps, desc=label, unit="step", position=i, disable=args.no_progress,
                  dynamic_ncols=True)
        for i, (key, label) in enumerate((step_bars or {}).items())
    }  # fmt: skip
    while pending or running:
        while pending and len(running) < args.jobs:
            key = pending.pop(0)
            progress_path(args.cache_dir, *key).unlink(missing_ok=True)
            log = open(logs / f"{key[0]}-{key[1]}-seed{key[2]}.log", "w")  # noqa: SIM115 (closed when it ends)
            running[key] = (subprocess.Popen(_child_command(args, *key), stdout=log, stderr=subprocess.STDOUT), log)
        time.sleep(1.0)
        for key, (proc, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[key]
            bar.update(1)
            name = f"{key[0]}/{key[1]}/seed{key[2]}"
            if proc.returncode != 0:
                failures.append(f"{name} failed (exit {proc.returncode}); log: {log.name}")
                bar.write(failures[-1])
            else:
                if key in bars:
                    bars[key].update(bars[key].total - bars[key].n)
                record = json.loads(run_path(args.results, *key).read_text())
                bar.write(f"{name}: held-out pass@1 {record['final']['pass_at_1']:.3f} ({record['seconds']:.0f}s)")
        steps = {key: _step(args.cache_dir, key) for key in running}
        for key, step_bar in bars.items():
            if steps.get(key):
                step_bar.update(steps[key][0] - step_bar.n)
        bar.set_postfix(
            running=", ".join(
                f"{t}/{a}/s{s}" + (f" {steps[(t, a, s)][0]}/{steps[(t, a, s)][1]}" if steps[(t, a, s)] else "")
                for t, a, s in running
            ),
            refresh=False,
        )
    for step_bar in bars.values():
        step_bar.close()
    bar.close()
    return failures


# ------------------------------------------------------------------------------------------------ the report
def _median_band(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _first_reaching(record: dict, target: float) -> int | None:
    for rollouts, value in zip(record["curve"]["rollouts"], record["curve"]["pass_at_1"]):
        if value is not None and value >= target - 1e-12:
            return rollouts
    return None


def summarize(runs: list[dict]) -> dict:
    """Per task and arm: final held-out pass@1 over seeds (median, min, max; overall and per difficulty), and the
    generated rollouts each seed needed to reach GRPO's final median, against GRPO's total."""
    by: dict[str, dict[str, list[dict]]] = {}
    for record in runs:
        by.setdefault(record["task"], {}).setdefault(record["arm"], []).append(record)
    summary: dict[str, Any] = {}
    for task, arms in by.items():
        grpo = arms.get("grpo", [])
        target = statistics.median(r["final"]["pass_at_1"] for r in grpo) if grpo else None
        grpo_rollouts = statistics.median(r["final"]["rollouts"] for r in grpo) if grpo else None
        warm = [r["curve"]["pass_at_1"][0] for rs in arms.values() for r in rs]
        summary[task] = {"grpo_final_median": target, "grpo_rollouts": grpo_rollouts, "arms": {}}
        summary[task]["warm_start_median"] = statistics.median(warm) if warm else None
        for arm, records in sorted(arms.items(), key=lambda kv: list(ARMS).index(kv[0]) if kv[0] in ARMS else 99):
            records = sorted(records, key=lambda r: r["seed"])
            finals = [r["final"]["pass_at_1"] for r in records]
            difficulties = sorted({d for r in records for d in r["final"]["by_difficulty"]}, key=float)
            entry = {
                "seeds": [r["seed"] for r in records],
                "final": dict(zip(("median", "min", "max"), _median_band(finals))),
                "final_per_seed": finals,
                "by_difficulty": {
                    d: statistics.median(r["final"]["by_difficulty"][d] for r in records) for d in difficulties
                },
                "rollouts": statistics.median(r["final"]["rollouts"] for r in records),
            }
            if target is not None:
                reach = [_first_reaching(r, target) for r in records]
                reached = [x for x in reach if x is not None]
                # median over seeds, a seed that never reached counting as infinitely many rollouts
                ordered = sorted(x if x is not None else math.inf for x in reach)
                median = statistics.median(ordered) if ordered else math.inf
                entry["rollouts_to_grpo_final"] = {
                    "per_seed": reach,
                    "reached": len(reached),
                    "median": None if math.isinf(median) else median,
                    "share_of_grpo": None if math.isinf(median) or not grpo_rollouts else median / grpo_rollouts,
                }
            summary[task]["arms"][arm] = entry
    return summary


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def band(final: dict) -> str:
    """A summary's final pass@1 as "median [min, max]"."""
    return f"{fmt(final['median'])} [{fmt(final['min'])}, {fmt(final['max'])}]"


def markdown(summary: dict) -> str:
    lines = []
    for task, s in summary.items():
        lines.append(f"### {task}: {TASKS[task].description if task in TASKS else ''}")
        lines.append("")
        lines.append(
            f"Warm start held-out pass@1 {fmt(s['warm_start_median'])}; "
            f"GRPO's final median {fmt(s['grpo_final_median'])} after {fmt(s['grpo_rollouts'], 0)} generated rollouts."
        )
        lines.append("")
        difficulties = sorted({d for a in s["arms"].values() for d in a["by_difficulty"]}, key=float)
        head = ["arm", "seeds", "final pass@1 median [min, max]", *[f"d={d}" for d in difficulties]]
        head += ["rollouts to GRPO's final (median)", "share of GRPO's", "seeds reaching"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for arm, a in s["arms"].items():
            reach = a.get("rollouts_to_grpo_final", {})
            share = reach.get("share_of_grpo")
            row = [
                arm,
                str(len(a["seeds"])),
                band(a["final"]),
                *[fmt(a["by_difficulty"].get(d)) for d in difficulties],
                fmt(reach.get("median"), 0) if reach.get("median") is not None else "not reached",
                "-" if share is None else f"{100 * share:.0f}%",
                f"{reach.get('reached', 0)}/{len(a['seeds'])}",
            ]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def figure(runs: list[dict], path: Path, arms: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in runs}, key=lambda t: list(TASKS).index(t) if t in TASKS else 99)
    cols = min(4, max(1, len(tasks)))  # four settings a row
    rows = max(1, math.ceil(len(tasks) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(tasks) :]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks):
        for arm in arms:
            records = [r for r in runs if r["task"] == task and r["arm"] == arm]
            if not records:
                continue
            n = min(len(r["curve"]["rollouts"]) for r in records)
            x = [statistics.median(r["curve"]["rollouts"][j] for r in records) / 1000 for j in range(n)]
            ys = [[r["curve"]["pass_at_1"][j] for r in records] for j in range(n)]
            median = [statistics.median(y) for y in ys]
            main = arm in MAIN_ARMS
            line = ax.plot(
                x, median, lw=2.2 if main else 1.0, ls="-" if main else "--", label=f"{arm} ({len(records)})"
            )
            ax.fill_between(
                x,
                [min(y) for y in ys],
                [max(y) for y in ys],
                color=line[0].get_color(),
                alpha=0.18 if main else 0.06,
                lw=0,
            )
        ax.set_title(task)
        ax.set_xlabel("generated rollouts (thousands)")
        ax.set_ylabel("held-out pass@1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(results: Path, tasks: list[str] | None, arms: list[str] | None) -> tuple[dict, str]:
    runs = []
    for path in sorted(results.glob("*/*/seed*.json")):
        record = json.loads(path.read_text())
        if (tasks is None or record["task"] in tasks) and (arms is None or record["arm"] in arms):
            runs.append(record)
    summary = summarize(runs)
    table = markdown(summary)
    (results / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    (results / "results.md").write_text(table + "\n")
    plotted = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    figure(runs, results / "study.png", plotted)
    if any(r["task"].startswith(SWEEP_FAMILY) for r in runs):
        table += "\n" + sweep_report(runs, results)
        (results / "results.md").write_text(table + "\n")
    return summary, table


def sweep_report(runs: list[dict], results: Path) -> str:
    """The regime table, the step-size sweep and its figure (`regimes`), written as sweep.json and sweep.png."""
    from . import regimes

    points = regimes.sweep(runs, SWEEP_FAMILY)
    old = [p for name in TASKS if not name.startswith(SWEEP_FAMILY) for p in regimes.sweep(runs, name)]
    by_task: dict[str, list[dict]] = {}
    order = list(TASKS)  # the earlier settings, then the sweep from its largest step to its smallest
    for record in sorted(runs, key=lambda r: order.index(r["task"]) if r["task"] in order else len(order)):
        by_task.setdefault(record["task"], []).append(record)
    stats = {name: regimes.regime_stats(records) for name, records in by_task.items()}
    noise = regimes.estimate_noise([r for r in runs if r["task"].startswith(SWEEP_FAMILY)])
    payload = {"points": points, "earlier_settings": old, "regimes": stats, "estimate_noise": noise}
    (results / "sweep.json").write_text(json.dumps(payload, indent=1) + "\n")
    regimes.sweep_figure(points, old, results / "sweep.png", noise["std"] if noise else None)
    lines = ["### Step-size sweep: ExGRPO minus GRPO (paired by seed, median [min, max])", ""]
    lines += [regimes.sweep_markdown(points, old), ""]
    if noise:
        lines += [
            f"Held-out estimate noise: one final model evaluated with {noise['evaluations_per_run']} sampling seeds "
            f"varies by {noise['std']:.4f} (standard deviation pooled over {noise['runs']} runs).",
            "",
        ]
    lines += ["### Regimes: the paper's run beside each setting", "", regimes.regime_markdown(stats), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ command line
QUICK = dict(steps=2, eval_every=1, eval_questions=8, eval_samples=2, train_questions=64, warm_start_steps=5)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exgrpo study", description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--arms", default=",".join(MAIN_ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,2,5 (default 0-4)")
    p.add_argument("--results", type=Path, default=Path(DEFAULT_RESULTS), help=f"default {DEFAULT_RESULTS}")
    p.add_argument("--cache-dir", type=Path, default=Path(DEFAULT_CACHE), help="warm starts and run logs")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at a time (default 2, one thread each)")
    p.add_argument("--report-only", action="store_true", help="train nothing: tables and figure from saved runs")
    p.add_argument("--quick", action="store_true", help="a smoke study in seconds: " + str(QUICK))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a task setting for every task of this call, e.g. learning_rate=2e-4 or steps=600 (use its own "
        "--results folder: saved runs are found by task, arm and seed only)",
    )
    p.add_argument("--run-one", nargs=3, metavar=("TASK", "ARM", "SEED"), help=argparse.SUPPRESS)
    return p


def _overrides(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` items as Task field values, typed like the field's default (int, float or str)."""
    fields = {f.name: f for f in dataclasses.fields(Task) if f.name not in ("load", "splits", "reward", "evaluate")}
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in fields or not value:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}")
        kind = type(getattr(TASKS[next(iter(TASKS))], name))
        out[name] = kind(float(value)) if kind is int else kind(value)
    return out


# The paper's generation batch (128 questions) would not fit in QUICK's 64 training questions.
QUICK_SWEEP = dict(prompts_per_step=8, final_eval_seeds=2)


def _tasks(quick: bool, overrides: dict[str, Any] | None = None) -> dict[str, Task]:
    tasks = {}
    for name, task in TASKS.items():
        big = task.generation_questions > QUICK["train_questions"]  # the paper's batch shape (sweep, difficulty)
        extra = {**(QUICK if quick else {}), **(QUICK_SWEEP if quick and big else {})}
        tasks[name] = dataclasses.replace(task, **{**extra, **(overrides or {})})  # --set wins over --quick
    return tasks


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tasks = _tasks(args.quick, _overrides(args.set))
    except ValueError as exc:
        print(f"exgrpo study: {exc}", file=sys.stderr)
        return 2
    if args.run_one:
        from ..utils.quiet import quiet

        task, arm, seed = args.run_one
        with quiet():
            run_one(
                tasks[task],
                arm,
                int(seed),
                run_path(args.results, task, arm, int(seed)),
                str(args.cache_dir),
                str(Path(args.cache_dir) / "study-trainer"),
            )
        return 0
    names = [t for t in args.tasks.split(",") if t]
    arms = [a for a in args.arms.split(",") if a]
    for name, known, what in [(n, TASKS, "task") for n in names] + [(a, ARMS, "arm") for a in arms]:
        if name not in known:
            print(f"exgrpo study: unknown {what} {name!r}; known: {', '.join(known)}", file=sys.stderr)
            return 2
    seeds = _parse_seeds(args.seeds)
    failures = []
    if not args.report_only:
        todo = [(t, a, s) for t in names for a in arms for s in seeds if not run_path(args.results, t, a, s).exists()]
        done = len(names) * len(arms) * len(seeds) - len(todo)
        print(f"exgrpo study: {len(todo)} runs to train, {done} found in {args.results}", flush=True)
        failures = run_missing(args, tasks, todo) if todo else []
    _, table = report(args.results, None, None)  # every saved run: a partial call must not shrink the report
    print(table)
    print(f"results: {args.results / 'results.json'}, {args.results / 'results.md'}, {args.results / 'study.png'}")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0
