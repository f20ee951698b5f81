"""The study: what ExGRPO buys over GRPO on the toy tasks, measured over seeds (`python -m lab.study`).

    python -m lab.study --tasks addition --arms grpo,exgrpo --seeds 0-4     # train what is missing, then report
    python -m lab.study --report-only                                        # the table and figure from the saved runs

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

Modules: `tasks` (the toy settings and the arms), `run` (one run and its record), `schedule` (runs in child
processes, resumed where they stopped), `report` (tables and figures), `regimes` (the regime table and the sweeps),
`cli` (the command line). Run from the repository's root folder: the lab is not part of the installed package.
"""

from __future__ import annotations

from .cli import main
from .report import band, fmt, markdown, report, summarize, sweep_report
from .run import STUDY_STATE, progress_path, run_one
from .schedule import run_missing, run_path
from .tasks import (
    ARMS,
    DEFAULT_CACHE,
    DEFAULT_RESULTS,
    DIFFICULTY_POINTS,
    HARD_POINT,
    MAIN_ARMS,
    PAPER_POINT,
    QUICK,
    SWEEP_FAMILY,
    TARGET_ROLLOUT_SHARE,
    TASKS,
    Arm,
    Task,
    build_tasks,
    parse_overrides,
)

__all__ = [
    "ARMS", "STUDY_STATE", "DEFAULT_CACHE", "DEFAULT_RESULTS", "DIFFICULTY_POINTS", "HARD_POINT", "MAIN_ARMS",
    "PAPER_POINT", "QUICK", "SWEEP_FAMILY", "TARGET_ROLLOUT_SHARE", "TASKS", "Arm", "Task", "band", "build_tasks",
    "fmt", "main", "markdown",
    "parse_overrides", "progress_path", "report", "run_missing", "run_one", "run_path", "summarize", "sweep_report",
]  # fmt: skip
