"""`python -m lab.demo` (`make demo`): GRPO and ExGRPO side by side on a toy verifiable task, on a CPU, in minutes.

The demo is one seed of the study (`python -m lab.study`; the README's section on what ExGRPO buys over GRPO): the same
task, settings and code (`study.run_one`), so its figures can be read against the study's table. Phases:
1. the task's supervised warm start (a ~1M-parameter Qwen2-shaped model and a char tokenizer, built locally), trained
   once and cached under `--cache-dir`;
2. TRL's `GRPOTrainer` and `ExGRPOTrainer` (the paper's settings) from that warm start with the same seed, trained
   at the same time in two processes with one thread each, each evaluating held-out pass@1 as it goes;
3. the comparison: held-out pass@1 by difficulty, generated rollouts (a replayed group generates K - 1), where ExGRPO
   reached GRPO's final figure, what replay did, and, when the study's saved results are at hand, where this seed
   stands among the study's seeds. It says which arm ended higher, whichever it is.

Output: a report on stdout, `OUT/results.json`, `OUT/figure.png` and each run's record under `OUT/runs/`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from exgrpo_trl.utils.requirements import MissingDependency, require

from . import study
from .study import fmt

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The setting that best shows the mechanism (README, the study): Countdown from the weak start, where questions have
# many correct expressions (so trajectory selection has a choice) and replay runs from the first step.
DEFAULT_TASK = "countdown-weak"
ARMS = ("grpo", "exgrpo")
LABELS = {"grpo": "GRPO (TRL GRPOTrainer)", "exgrpo": "ExGRPO (ExGRPOTrainer)"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lab.demo",
        description="GRPO and ExGRPO side by side on a toy verifiable task with a tiny local model, on a CPU: one "
        "seed of `python -m lab.study`. Prints the comparison and writes OUT/results.json and OUT/figure.png.",
    )
    p.add_argument(
        "--task",
        default=DEFAULT_TASK,
        choices=list(study.TASKS),
        help=f"the toy task and warm start (default {DEFAULT_TASK}): "
        + "; ".join(f"{name}: {t.description}" for name, t in study.TASKS.items()),
    )
    p.add_argument("--seed", type=int, default=0, help="seed of both runs and of the evaluation sampling (default 0)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the task's, as studied)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (default runs/demo)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(study.DEFAULT_CACHE),
        help=f"warm starts (default {study.DEFAULT_CACHE})",
    )
    p.add_argument(
        "--study-results",
        type=Path,
        default=Path(study.DEFAULT_RESULTS),
        help=f"the study's saved runs, to place this seed among them (default {study.DEFAULT_RESULTS}; skipped when "
        "absent)",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs trained at a time (default 2, one thread each)")
    p.add_argument("--quick", action="store_true", help="a smoke run in seconds: " + str(study.QUICK))
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


# ------------------------------------------------------------------------------------------ the comparison
def _difficulty_label(task: study.Task, d: str) -> str:
    if task.difficulty == "digits":
        return f"{d} digit" + ("s" if d != "1" else "")
    return f"needs {d} numbers"


def _reached(record: dict, target: float) -> tuple[int, int] | None:
    """(step, generated rollouts) of the first evaluation at or above `target`, if any."""
    curve = record["curve"]
    for step, rollouts, value in zip(curve["step"], curve["rollouts"], curve["pass_at_1"]):
        if value is not None and value >= target - 1e-12:
            return step, rollouts
    return None


def compare(task: study.Task, records: dict[str, dict]) -> dict:
    """The demo's figures from the two runs' records (see `study.run_one` for their fields)."""
    grpo, ex = records["grpo"], records["exgrpo"]
    target = grpo["final"]["pass_at_1"]
    reach = _reached(ex, target)
    steps = ex["steps"]
    replay_steps = [i + 1 for i, n in enumerate(steps["replayed"]) if n]
    probes = ex.get("probes", {})
    return {
        "warm_start": {
            "overall": grpo["curve"]["pass_at_1"][0],
            "by_difficulty": {d: v[0] for d, v in grpo["curve"]["by_difficulty"].items()},
        },
        "final": {arm: {"overall": r["final"]["pass_at_1"], **r["final"]} for arm, r in records.items()},
        "difference": ex["final"]["pass_at_1"] - target,
        "grpo_final": target,
        "exgrpo_reached_grpo_final": None
        if reach is None
        else {"step": reach[0], "rollouts": reach[1], "share_of_grpo": reach[1] / grpo["final"]["rollouts"]},
        "exgrpo_best": max(ex["curve"]["pass_at_1"]),
        "replay": {
            "first_step": replay_steps[0] if replay_steps else None,
            "replayed_per_step_after_start": statistics.mean(steps["replayed"][replay_steps[0] - 1 :])
            if replay_steps
            else 0.0,
            "groups_per_step": task.prompts_per_step,
            **ex["replay_counts"],
            "buffer_questions": steps["buffer_questions"][-1],
            "retired": steps["retired"][-1],
            "probe_most_replayed": probes.get("replayed"),
            "probe_retired": probes.get("retired"),
        },
        "seconds": {arm: r["seconds"] for arm, r in records.items()},
    }


def _study_context(results: Path, task: str) -> dict | None:
    """The study's saved GRPO and ExGRPO runs of this task, summarised; None when there are none."""
    runs = []
    for arm in ARMS:
        for path in sorted((results / task / arm).glob("seed*.json")):
            runs.append(json.loads(path.read_text()))
    if not any(r["arm"] == "grpo" for r in runs) or not any(r["arm"] == "exgrpo" for r in runs):
        return None
    return study.summarize(runs)[task]


def sweep_lines(results: Path) -> list[str]:
    """The study's step-size sweep (`sweep.json`, written by `python -m lab.study`), one line a step size: ExGRPO minus
    GRPO in final held-out pass@1, paired by seed; empty when the study has no sweep."""
    path = results / "sweep.json"
    if not path.is_file():
        return []
    payload = json.loads(path.read_text())
    points = sorted(payload["points"] + payload["earlier_settings"], key=lambda p: -p["step_size"])
    if not points:
        return []
    lines = ["", f"The study across step sizes (learning rate / questions per update; {path}):"]
    for p in points:
        d = p["final_updates"]
        lines.append(
            f"  {p['step_size']:.1e}  {p['task']:<26} ExGRPO - GRPO final, equal updates {d['median']:+.3f} "
            f"[{d['min']:+.3f}, {d['max']:+.3f}] over {d['seeds']} paired seed{'s' if d['seeds'] != 1 else ''}"
        )
    noise = payload.get("estimate_noise")
    if noise:
        lines.append(f"  (one model's held-out estimate varies by {noise['std']:.4f} between sampling seeds)")
    return lines


def report_text(task: study.Task, records: dict[str, dict], c: dict, context: dict | None, seed: int) -> str:
    grpo, ex = records["grpo"], records["exgrpo"]
    cols = ("warm start", "GRPO", "ExGRPO")
    title = f"held-out pass@1 ({task.eval_questions} questions x {task.eval_samples} samples)"
    width = max(len(title), 20)
    lines = [f"{title:<{width}}" + "".join(f"{col:>12}" for col in cols), "-" * (width + 36)]
    difficulties = sorted(c["warm_start"]["by_difficulty"], key=float)
    for d in difficulties:
        row = [c["warm_start"]["by_difficulty"].get(d)] + [c["final"][a]["by_difficulty"].get(d) for a in ARMS]
        lines.append(f"{_difficulty_label(task, d):<{width}}" + "".join(f"{fmt(v):>12}" for v in row))
    row = [c["warm_start"]["overall"]] + [c["final"][a]["overall"] for a in ARMS]
    lines.append(f"{'overall':<{width}}" + "".join(f"{fmt(v):>12}" for v in row))
    lines.append(
        f"{'generated rollouts':<{width}}{'':>12}" + "".join(f"{c['final'][a]['rollouts']:>12,}" for a in ARMS)
    )
    lines.append(f"{'training time':<{width}}{'':>12}" + "".join(f"{c['seconds'][a]:>11.0f}s" for a in ARMS))
    lines.append("")

    diff = round(c["difference"], 4)
    verdict = (
        f"{abs(diff):.3f} higher than" if diff > 0 else f"{abs(diff):.3f} lower than" if diff < 0 else "level with"
    )
    lines.append(f"This seed ({seed}): ExGRPO ends {verdict} GRPO ({fmt(ex['final']['pass_at_1'])} against "
                 f"{fmt(c['grpo_final'])}).")  # fmt: skip
    reach = c["exgrpo_reached_grpo_final"]
    if reach is None:
        lines.append(
            f"ExGRPO never reached GRPO's final held-out pass@1 ({fmt(c['grpo_final'])}); its best evaluation was "
            f"{fmt(c['exgrpo_best'])}."
        )
    else:
        lines.append(
            f"ExGRPO first reached GRPO's final held-out pass@1 ({fmt(c['grpo_final'])}) at step {reach['step']}, "
            f"after {reach['rollouts']:,} generated rollouts: {100 * reach['share_of_grpo']:.0f}% of GRPO's "
            f"{grpo['final']['rollouts']:,} (the study's target: at most {100 * study.TARGET_ROLLOUT_SHARE:.0f}%, "
            "median of 5 seeds)."
        )
    r = c["replay"]
    if r["first_step"] is None:
        lines.append(
            "ExGRPO replayed nothing: replay needs a batch pass rate above replay_start_pass_rate and buffered "
            "questions in the buckets it draws from."
        )
    else:
        lines.append(
            f"ExGRPO's replay: from step {r['first_step']}, {r['replayed_per_step_after_start']:.1f} of "
            f"{r['groups_per_step']} groups per step were replayed questions; {r['replays']:,} replays on "
            f"{r['questions_replayed']:,} training questions (at most {r['max']} on one). At the end the buffer held "
            f"{r['buffer_questions']} questions and {r['retired']} were retired."
        )
    for name, what in (("probe_most_replayed", "the {n} most replayed"), ("probe_retired", "{n} of the retired")):
        probe = r.get(name)
        if probe:
            lines.append(
                f"Pass@1 on {what.format(n=probe['questions'])} training questions: "
                f"{fmt(probe['warm_start']['overall'])} at the warm start, "
                f"{fmt(probe['final']['overall'])} at the end."
            )
    if context is not None:
        g, e = context["arms"]["grpo"], context["arms"]["exgrpo"]
        share = e.get("rollouts_to_grpo_final", {}).get("share_of_grpo")
        lines.append("")
        lines.append(
            f"The study ({len(g['seeds'])} GRPO and {len(e['seeds'])} ExGRPO seeds of {task.name}): final held-out "
            f"pass@1 GRPO {study.band(g['final'])}, ExGRPO {study.band(e['final'])} "
            "(median [min, max]); ExGRPO "
            + (
                f"reached GRPO's final median with {100 * share:.0f}% of GRPO's rollouts (median over seeds)."
                if share is not None
                else "did not reach GRPO's final median on most seeds."
            )
        )
    return "\n".join(lines)


def figure(task: study.Task, records: dict[str, dict], c: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "tab:blue", "exgrpo": "tab:red"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax = axes[0, 0]
    for arm, record in records.items():
        x = [n / 1000 for n in record["curve"]["rollouts"]]
        ax.plot(x, record["curve"]["pass_at_1"], "o-", ms=3, color=colors[arm], lw=2, label=LABELS[arm])
    ax.axhline(c["grpo_final"], color="tab:blue", ls=":", lw=1, label="GRPO's final")
    reach = c["exgrpo_reached_grpo_final"]
    if reach is not None:
        ax.axvline(reach["rollouts"] / 1000, color="tab:red", ls=":", lw=1, label="ExGRPO reaches it")
    ax.set(title="held-out pass@1", xlabel="generated rollouts (thousands)", ylabel="pass@1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    difficulties = sorted(c["warm_start"]["by_difficulty"], key=float)
    names = [("warm start", "tab:gray", c["warm_start"])] + [(LABELS[a], colors[a], c["final"][a]) for a in ARMS]
    for i, (label, color, values) in enumerate(names):
        ys = [values["by_difficulty"].get(d, 0.0) for d in difficulties] + [values["overall"]]
        ax.bar([x + (i - 1) * 0.27 for x in range(len(ys))], ys, 0.27, color=color, label=label)
    short = [_difficulty_label(task, d).removeprefix("needs ") for d in difficulties]
    ax.set_xticks(range(len(difficulties) + 1), [*short, "overall"])
    ax.set(title="held-out pass@1 at the end, by difficulty", ylabel="pass@1")
    ax.legend(fontsize=8)

    steps = records["exgrpo"]["steps"]
    x = list(range(1, len(steps["replayed"]) + 1))
    ax = axes[1, 0]
    ax.plot(x, steps["buffer_questions"], color="tab:red", lw=2, label="buffer (questions)")
    ax.plot(x, steps["retired"], color="tab:gray", lw=2, label="retired (questions)")
    ax.set(title="ExGRPO's experience", xlabel="optimizer step", ylabel="questions")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(x, steps["replayed"], color="k", lw=0.8, alpha=0.6, label="replayed groups per step")
    ax2.set_ylim(0, task.prompts_per_step)
    ax2.set_ylabel("replayed groups per step (thin)")
    ax.legend(loc="upper left", fontsize=8)

    ax = axes[1, 1]
    hist = {int(k): v for k, v in records["exgrpo"]["replay_counts"]["histogram"].items()}
    if hist:
        ax.bar(list(hist), list(hist.values()), color="tab:red")
    else:
        ax.text(0.5, 0.5, "nothing replayed", ha="center", va="center", transform=ax.transAxes)
    ax.set(title="how often each training question was replayed", xlabel="replays", ylabel="questions")
    fig.suptitle(f"GRPO vs ExGRPO on {task.name} (tiny Qwen2, {task.steps} steps, seed {records['grpo']['seed']})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # the figure is drawn after minutes of training
        require("matplotlib", "make demo")
    except MissingDependency as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 1
    overrides = {"steps": args.steps} if args.steps else {}
    tasks = study.build_tasks(args.quick, overrides)
    task = tasks[args.task]
    runs_dir = args.out / "runs"
    keys = [(task.name, arm, args.seed) for arm in ARMS]
    for key in keys:  # the demo trains afresh every time
        study.run_path(runs_dir, *key).unlink(missing_ok=True)
    print(
        f"demo: {task.name} ({task.description}); seed {args.seed}, {task.steps} steps of "
        f"{task.prompts_per_step} questions x {task.num_generations} rollouts, lr {task.learning_rate:g}, held-out "
        f"pass@1 every {task.eval_every} steps",
        flush=True,
    )
    import torch

    from exgrpo_trl.utils.threads import default_cpu_threads

    from .quiet import quiet

    # The warm start runs here, the two arms in one-thread processes: one thread here too, as a busy machine would
    # otherwise slow it down 5-17 times (utils/threads.py).
    torch.set_num_threads(default_cpu_threads())
    t0 = time.perf_counter()
    with quiet():
        task.load(str(args.cache_dir), task.warm_start_steps, not args.no_progress)
    print(
        f"warm start: {task.warm_start_steps} supervised steps, ready in {time.perf_counter() - t0:.0f}s", flush=True
    )

    # the study's child processes, with the demo's task settings (--quick, --steps) passed on
    child = argparse.Namespace(
        results=runs_dir,
        cache_dir=args.cache_dir,
        jobs=args.jobs,
        quick=args.quick,
        no_progress=args.no_progress,
        set=[f"{k}={v}" for k, v in overrides.items()],
    )
    with quiet():
        failures = study.run_missing(child, tasks, keys, step_bars={key: LABELS[key[1]] for key in keys})
    for failure in failures:
        print(f"demo: {failure}", file=sys.stderr)
    if failures:
        return 1
    records = {arm: json.loads(study.run_path(runs_dir, *key).read_text()) for arm, key in zip(ARMS, keys)}
    comparison = compare(task, records)
    context = None if args.quick or args.steps else _study_context(args.study_results, task.name)
    text = report_text(task, records, comparison, context, args.seed)
    if not (args.quick or args.steps):
        text = "\n".join([text, *sweep_lines(args.study_results)])
    results = {
        "task": task.name,
        "seed": args.seed,
        "settings": records["exgrpo"]["settings"]["task"],
        "comparison": comparison,
        "study": context,
        "runs": {arm: str(study.run_path(runs_dir, *key)) for arm, key in zip(ARMS, keys)},
        "figure": "figure.png",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with quiet():
        figure(task, records, comparison, args.out / "figure.png")
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print()
    print(text)
    print()
    print(
        f"total time {results['seconds']:.0f}s; results: {args.out / 'results.json'}, "
        f"figure: {args.out / 'figure.png'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
