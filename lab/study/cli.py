"""`python -m lab.study`: train the runs that are missing, then write the report.

python -m lab.study --tasks countdown-hard --arms grpo,exgrpo --seeds 0-4
python -m lab.study --report-only
python -m lab.study --confirm                       # the registered study (lab.study.confirm)
python -m lab.study --policies                      # the registered comparison of replay rules (lab.study.policies)
python -m lab.study --verify RUN.json --updates 50  # retrain a run's first updates, compare what the analysis reads
python -m lab.study --replicate addition --seeds 25-27  # a registered setting's arms at fresh seeds, on this machine

Warm starts come from the repository (lab/warm_starts) where one ships for the setting; --rebuild-warm-start trains
them afresh into --cache-dir and says whether the weights equal the shipped ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..warm_start import SOURCES, warm_start_source
from . import confirm, policies, replicate
from .report import report
from .run import run_one
from .schedule import _parse_seeds, run_missing, run_path
from .tasks import ARMS, DEFAULT_CACHE, DEFAULT_RESULTS, MAIN_ARMS, QUICK, TASKS, build_tasks, parse_overrides

DESCRIPTION = "GRPO against ExGRPO and ablations on the toy tasks, over seeds; resumable."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.study", description=DESCRIPTION)
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument(
        "--arms",
        default=None,
        help=f"comma-separated, of {', '.join(ARMS)} (default {','.join(MAIN_ARMS)}; with --replicate the registered "
        f"arms, {','.join(confirm.ARMS)})",
    )
    p.add_argument("--seeds", default=None, help="e.g. 0-4 or 0,2,5 (default 0-4; --replicate needs them)")
    p.add_argument(
        "--results", type=Path, default=None, help=f"default {DEFAULT_RESULTS} ({confirm.RESULTS} with --confirm)"
    )
    p.add_argument("--cache-dir", type=Path, default=Path(DEFAULT_CACHE), help="warm starts and run logs")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at a time (default 2, one thread each)")
    p.add_argument("--report-only", action="store_true", help="train nothing: tables and figure from saved runs")
    p.add_argument(
        "--control",
        action="store_true",
        help="train nothing: the over-fitting control (GRPO's final model on each run's most replayed and matched "
        "never-replayed questions), written to RESULTS/control.md",
    )
    p.add_argument(
        "--confirm",
        action="store_true",
        help=f"the registered study ({confirm.RESULTS}/plan.md): its runs in its order, from a committed tree and "
        "the commit of the runs already saved, then its analysis (with --report-only: the analysis only)",
    )
    p.add_argument(
        "--policies",
        action="store_true",
        help=f"the registered comparison of replay rules ({policies.RESULTS}/plan.md), run and read like --confirm",
    )
    p.add_argument(
        "--verify",
        type=Path,
        metavar="RUN.json",
        help="retrain the first --updates updates of a saved run at this checkout, compare what the analysis reads: "
        "settings against today's task and arm (give the run's --quick / --set), hashes, config, then every record on "
        "the run's machine type, or only what must be equal on another (exit 1 on a mismatch)",
    )
    p.add_argument("--updates", type=int, default=50, help="updates --verify retrains (default 50)")
    p.add_argument(
        "--replicate",
        metavar="SETTING",
        choices=confirm.SETTINGS,
        help=f"train a registered setting's arms at fresh --seeds (not 0-24) from the shipped warm start, then print "
        f"where each lands against the registered runs (results in {replicate.DEFAULT_RESULTS} unless --results)",
    )
    p.add_argument(
        "--rebuild-warm-start",
        action="store_true",
        help="train the warm starts afresh into --cache-dir instead of loading the shipped ones, and say whether "
        "the weights equal them (runs record which they trained from)",
    )
    p.add_argument("--warm-start-source", choices=SOURCES, help=argparse.SUPPRESS)
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.results is None:
        args.results = Path(
            confirm.RESULTS
            if args.confirm
            else policies.RESULTS
            if args.policies
            else replicate.DEFAULT_RESULTS
            if args.replicate
            else DEFAULT_RESULTS
        )
    if args.arms is None:
        args.arms = ",".join(confirm.ARMS if args.replicate else MAIN_ARMS)
    warm_start_source("rebuild" if args.rebuild_warm_start else args.warm_start_source or "shipped")
    if args.replicate and (args.quick or args.set or args.seeds is None):
        print("lab.study: --replicate trains the registered setting as it is, at fresh --seeds: give --seeds, and no "
              "--quick or --set", file=sys.stderr)  # fmt: skip
        return 2
    args.seeds = args.seeds or "0-4"
    if args.confirm and args.policies:
        print("lab.study: --confirm and --policies are two registered studies: give one", file=sys.stderr)
        return 2
    for flag in ("confirm", "policies"):
        if getattr(args, flag) and (args.quick or args.set):
            print(f"lab.study: --{flag} runs the registered settings as they are: no --quick or --set",
                  file=sys.stderr)  # fmt: skip
            return 2
    try:
        tasks = build_tasks(args.quick, parse_overrides(args.set))
    except ValueError as exc:
        print(f"lab.study: {exc}", file=sys.stderr)
        return 2
    if args.verify is not None:
        from .verify import verify

        try:
            ok, text = verify(args.verify, args.updates, str(args.cache_dir), tasks)
        except (OSError, ValueError, KeyError) as exc:
            print(f"lab.study: --verify {args.verify}: {exc}", file=sys.stderr)
            return 2
        print(text)
        return 0 if ok else 1
    if args.run_one:
        from ..quiet import quiet

        task, arm, seed = args.run_one
        with quiet():
            run_one(
                tasks[task],
                arm,
                int(seed),
                run_path(args.results, task, arm, int(seed)),
                str(args.cache_dir),
                str(Path(args.cache_dir) / "study-trainer"),
                confirmatory=args.confirm,
            )
        return 0
    if args.confirm:
        return _registered(args, tasks, confirm)
    if args.policies:
        return _registered(args, tasks, policies)
    if args.replicate:
        return _replicate(args, tasks)
    if args.control:
        from .control import write_control

        print(write_control(args.results, str(args.cache_dir), tasks))
        return 0
    names = [t for t in args.tasks.split(",") if t]
    arms = [a for a in args.arms.split(",") if a]
    for name, known, what in [(n, TASKS, "task") for n in names] + [(a, ARMS, "arm") for a in arms]:
        if name not in known:
            print(f"lab.study: unknown {what} {name!r}; known: {', '.join(known)}", file=sys.stderr)
            return 2
    seeds = _parse_seeds(args.seeds)
    failures = []
    if not args.report_only:
        todo = [(t, a, s) for t in names for a in arms for s in seeds if not run_path(args.results, t, a, s).exists()]
        done = len(names) * len(arms) * len(seeds) - len(todo)
        print(f"lab.study: {len(todo)} runs to train, {done} found in {args.results}", flush=True)
        failures = run_missing(args, tasks, todo) if todo else []
    _, table = report(args.results, None, None)  # every saved run: a partial call must not shrink the report
    print(table)
    print(f"results: {args.results / 'results.json'}, {args.results / 'results.md'}, {args.results / 'study.png'}")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


def _registered(args, tasks, plan) -> int:
    """A registered study (`plan`: lab.study.confirm or lab.study.policies): refuse an uncommitted tree or another
    commit's runs, train what is missing in the registered order, then the analysis (and the usual report and
    figures)."""
    from .provenance import LAB_ROOT, DirtyTree, require_clean

    flag = "confirm" if plan is confirm else "policies"
    failures = []
    if not args.report_only:
        try:
            commit = require_clean(LAB_ROOT)["commit"]
            confirm.check_one_commit(args.results, commit)  # one commit per registered study
        except (DirtyTree, ValueError) as exc:
            print(f"lab.study: --{flag}: {exc}", file=sys.stderr)
            return 2
        todo = [key for key in plan.registered_order() if not run_path(args.results, *key).exists()]
        done = len(plan.registered_order()) - len(todo)
        print(f"lab.study: the registered study at {commit[:12]}: {len(todo)} runs to train, {done} found", flush=True)
        failures = run_missing(args, tasks, todo) if todo else []
    if any(args.results.glob("*/*/seed*.json")):
        # the usual report; exgrpo - grpo is a registered comparison in confirm's plan, not in policies'
        report(args.results, None, None, compare=plan is confirm)
    _, text = plan.analyse(args.results)
    print(text)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


def _replicate(args, tasks) -> int:
    """A registered setting's arms at fresh seeds (`lab.study.replicate`): train what is missing, then the reading."""
    seeds = _parse_seeds(args.seeds)
    arms = [a for a in args.arms.split(",") if a]
    try:
        replicate.check_seeds(seeds)
        for arm in arms:
            if arm not in ARMS:
                raise ValueError(f"--arms: unknown arm {arm!r}; known: {', '.join(ARMS)}")
    except ValueError as exc:
        print(f"lab.study: {exc}", file=sys.stderr)
        return 2
    setting = args.replicate
    todo = [(setting, a, s) for a in arms for s in seeds if not run_path(args.results, setting, a, s).exists()]
    print(f"lab.study: replicating {args.replicate} at seeds {', '.join(map(str, seeds))}: {len(todo)} runs to train",
          flush=True)  # fmt: skip
    failures = run_missing(args, tasks, todo) if todo else []
    print(replicate.write(args.results, args.replicate))
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0
