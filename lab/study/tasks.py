"""The study's settings: the toy tasks (addition, Countdown at several starts, steps and difficulties) and the arms.

A `Task` holds everything a run needs, fixed per task and the same for every arm; an `Arm` names the trainer and
the ExGRPOConfig fields it sets on top of the paper's defaults. How each setting was chosen: docs/study.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    from ..warm_start import load_or_train_warm_start

    return load_or_train_warm_start(cache_dir, steps=warm_start_steps, seed=0, progress=progress, **TOY_MODEL)


def _addition_splits(n_train, n_eval, cache_dir=None):
    from exgrpo_trl.tasks.toy import addition_splits

    return addition_splits(n_train, n_eval, seed=0)


def _addition_reward(completions, answer, **kwargs):
    from exgrpo_trl.tasks.toy import addition_reward

    return addition_reward(completions, answer, **kwargs)


def _addition_evaluate(model, tokenizer, dataset, samples, seed):
    from exgrpo_trl.tasks.toy import evaluate_pass_at_1

    result = evaluate_pass_at_1(model, tokenizer, dataset, samples=samples, seed=seed, progress=False)
    return {"overall": result["overall"], "by_difficulty": result["by_digits"], "per_question": result["per_question"]}


def _countdown_load(cache_dir, warm_start_steps, progress):
    from ..countdown import countdown_warm_start

    return countdown_warm_start(cache_dir, warm_start_steps, seed=0, progress=progress)


def _countdown_splits(n_train, n_eval, cache_dir=None):
    from ..countdown import countdown_splits

    return countdown_splits(n_train, n_eval, seed=0)


def _countdown_pool_splits(n_train, n_eval, cache_dir=None):
    from ..countdown import countdown_pool_splits

    return countdown_pool_splits(n_train, n_eval, cache_dir=cache_dir, seed=0)


def _countdown_reward(completions, numbers, target, **kwargs):
    from ..countdown import countdown_reward

    return countdown_reward(completions, numbers, target, **kwargs)


def _countdown_evaluate(model, tokenizer, dataset, samples, seed):
    from ..countdown import evaluate_countdown

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
        learning_rate=5e-5,  # chosen on GRPO alone: docs/study.md, "The earlier settings"
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
    # Countdown (lab.countdown): many correct expressions per question. Held-out questions are a fixed
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
# The warm start, and the learning rates with their lengths, were chosen on GRPO alone: docs/study.md, "The
# paper-shaped setting". 2.5e-5 is the paper-shaped point; 1.25e-5 the smallest step the CPU allows in 600 updates.
SWEEP_WARM_START = 2000
# learning rate -> optimizer updates
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
HARD_WARM_START = 300


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
# The difficulty axis, each at the paper's step: the paper-shaped point (delayed start) and the hard point.
DIFFICULTY_POINTS = (PAPER_POINT, HARD_POINT)


@dataclass(frozen=True)
class Arm:
    description: str
    exgrpo: dict | None  # ExGRPOConfig fields on top of the paper's defaults; None: TRL's GRPOTrainer


_PAPER = {"max_trajectory_candidates": None}  # the paper scores every stored trajectory
MAX_AGE_UPDATES = "max_age_updates"  # an arm's age limit in optimizer updates (`arm_settings`), not a config field
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
    # What replay costs at the hard point (docs/study.md, "What replay costs"): the dose (half the paper's replay
    # ratio) and the concentration (a reuse limit: a replayed question sits out the next 9 generation batches, so no
    # question is replayed more than once in 10; `uniform_questions` is the other concentration arm).
    "replay_quarter": Arm("dose: replay_ratio 0.25 (the paper: 0.5)", {**_PAPER, "replay_ratio": 0.25}),
    "reuse_limit": Arm(
        "concentration: reuse limit, a replayed question sits out the next 9 generation batches",
        {**_PAPER, "replay_cooldown": 9},
    ),
    # Offline guidance (docs/algorithm.md, section 11): the task's `answer` column holds one correct solution per
    # question (Countdown: the expression its target was made from), put as the first row of each fresh group.
    "luffy": Arm(
        "LUFFY: an offline solution in every fresh group, no replay",
        {"replay_ratio": 0.0, "offline_solutions_column": "answer"},
    ),
    "exgrpo_offline": Arm(
        "ExGRPO with an offline solution in every fresh group",
        {**_PAPER, "offline_solutions_column": "answer"},
    ),
    # The replay rules of arXiv 2606.04560 on ExGRPO (benchmarks/results/policies/plan.md): an age limit of tau_max
    # optimizer updates (`MAX_AGE_UPDATES`, turned into generation batches per task by `arm_settings`) and questions
    # drawn in proportion to the |advantage| their stored success carried; together, and each alone.
    "rollout_recipe": Arm(
        "the rollout-level recipe: an age limit of 10 updates and advantage priority",
        {**_PAPER, MAX_AGE_UPDATES: 10, "replay_priority": "advantage"},
    ),
    "age_limit": Arm("component: the age limit of 10 updates alone", {**_PAPER, MAX_AGE_UPDATES: 10}),
    "advantage_priority": Arm("component: advantage priority alone", {**_PAPER, "replay_priority": "advantage"}),
}
MAIN_ARMS = ("grpo", "exgrpo")


def arm_settings(task: Task, arm: Arm) -> dict[str, Any]:
    """The ExGRPOConfig fields a run of `arm` on `task` sets: the task's, then the arm's, with an age limit given in
    optimizer updates (`MAX_AGE_UPDATES`) turned into the generation batches `replay_max_age` counts (a trajectory
    replayed a generation batches after it was collected has seen a x steps_per_generation updates)."""
    settings = {**task.exgrpo, **(arm.exgrpo or {})}
    updates = settings.pop(MAX_AGE_UPDATES, None)
    if updates is not None:
        if updates % task.steps_per_generation:
            raise ValueError(
                f"{MAX_AGE_UPDATES} {updates} is not a whole number of generation batches of {task.name} "
                f"({task.steps_per_generation} updates each)"
            )
        settings["replay_max_age"] = updates // task.steps_per_generation
    return settings


# ------------------------------------------------------------------------------------------------ smoke sizes
QUICK = dict(steps=2, eval_every=1, eval_questions=8, eval_samples=2, train_questions=64, warm_start_steps=5)


def parse_overrides(items: list[str]) -> dict[str, Any]:
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


def build_tasks(quick: bool, overrides: dict[str, Any] | None = None) -> dict[str, Task]:
    """Every task, shrunk to a smoke size with `quick`, with `overrides` (`parse_overrides`) applied on top."""
    tasks = {}
    for name, task in TASKS.items():
        big = task.generation_questions > QUICK["train_questions"]  # the paper's batch shape (sweep, difficulty)
        extra = {**(QUICK if quick else {}), **(QUICK_SWEEP if quick and big else {})}
        tasks[name] = dataclasses.replace(task, **{**extra, **(overrides or {})})  # --set wins over --quick
    return tasks
