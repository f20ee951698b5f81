"""`python -m lab.study --verify RUN.json --updates 50`: retrain the first updates of a saved run and compare every
record with its JSON.

The run's task, arm and seed come from the JSON (its settings, `--quick` and `--set` included); the first `updates`
optimizer updates are trained again from scratch at this checkout, and compared one by one with what the JSON saved:
the identity of what it trained from (warm-start weights, training pool, held-out set) and the fully resolved config
(`provenance`), the settings, every held-out evaluation up to there, every per-update record and every generation
batch's record that finished by then. Runs are deterministic on the CPU with one thread, so every value must be
equal, not close. Library versions and the commit are shown beside the result, not compared: they say where to look
when something differs.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from .tasks import ARMS, TASKS, Task


def task_from_settings(recorded: dict[str, Any]) -> Task:
    """The task a run trained, from its saved `settings.task` (the task's fields as the run had them)."""
    name = recorded["name"]
    if name not in TASKS:
        raise ValueError(f"the run's task {name!r} is not a task of this checkout ({', '.join(TASKS)})")
    known = {f.name for f in dataclasses.fields(Task)}
    return dataclasses.replace(TASKS[name], **{k: v for k, v in recorded.items() if k in known})


@dataclasses.dataclass
class Comparison:
    """One kind of record: how many values were compared and the differences found (at most a few are kept)."""

    what: str
    compared: int = 0
    differences: list[str] = dataclasses.field(default_factory=list)
    missing: int = 0  # differences beyond those kept

    def check(self, where: str, saved: Any, rerun: Any) -> None:
        self.compared += 1
        if saved != rerun:
            if len(self.differences) < 5:
                self.differences.append(f"{where}: saved {saved!r}, retrained {rerun!r}")
            else:
                self.missing += 1

    @property
    def equal(self) -> bool:
        return not self.differences

    def line(self) -> str:
        if self.equal:
            return f"  {self.what}: {self.compared} equal"
        more = f" (and {self.missing} more)" if self.missing else ""
        shown = "\n      ".join(self.differences)
        n = len(self.differences) + self.missing
        return f"  {self.what}: {n} of {self.compared} DIFFER{more}\n      {shown}"


def compare(saved: dict[str, Any], rerun: dict[str, Any], updates: int) -> list[Comparison]:
    """Every record of `rerun` (the first `updates` updates retrained) against the same records of `saved`."""
    rerun = json.loads(json.dumps(rerun))  # as a saved JSON holds it
    out = []
    identity = Comparison("warm start, training pool, held-out set (sha256)")
    made, remade = saved.get("provenance"), rerun["provenance"]
    if made is not None:
        for key in ("warm_start_sha256", "train_pool_sha256", "held_out_sha256"):
            identity.check(key, made.get(key), remade.get(key))
        out.append(identity)
        config = Comparison("resolved config fields")
        for key in sorted(set(made["config"]) | set(remade["config"])):
            config.check(f"config.{key}", made["config"].get(key, "<absent>"), remade["config"].get(key, "<absent>"))
        out.append(config)
    settings = Comparison("settings (task, arm, trainer, config overrides)")
    for part in ("task", "arm", "trainer", "config"):
        settings.check(f"settings.{part}", saved["settings"][part], rerun["settings"][part])
    out.append(settings)

    curve = Comparison(f"held-out evaluations up to update {updates}")
    for i, step in enumerate(saved["curve"]["step"]):
        if step > updates:
            break
        for key in ("step", "rollouts", "pass_at_1"):
            curve.check(f"curve.{key}[{i}] (update {step})", saved["curve"][key][i], _at(rerun["curve"][key], i))
        for d, values in saved["curve"]["by_difficulty"].items():
            got = _at(rerun["curve"]["by_difficulty"].get(d, []), i)
            curve.check(f"curve.by_difficulty[{d}][{i}] (update {step})", values[i], got)
    out.append(curve)

    steps = Comparison(f"per-update records, updates 1-{updates}")
    for key, values in saved["steps"].items():
        for i, value in enumerate(values[:updates]):
            steps.check(f"steps.{key}[{i}] (update {i + 1})", value, _at(rerun["steps"].get(key, []), i))
    out.append(steps)

    spg = saved["settings"]["task"].get("steps_per_generation", 1)
    batches = Comparison(f"generation-batch records finished by update {updates}")
    rerun_batches = {b["step"]: b for b in rerun.get("batches", [])}
    for b in saved.get("batches", []):
        if b["step"] + spg > updates:  # its last update (and its importance weights) falls later
            continue
        other = rerun_batches.get(b["step"], {})
        for key, value in b.items():
            batches.check(f"batches[update {b['step']}].{key}", value, other.get(key, "<absent>"))
    out.append(batches)
    return out


def _at(values: list, i: int) -> Any:
    return values[i] if i < len(values) else "<absent>"


def _versions(provenance: dict[str, Any] | None) -> str:
    if not provenance:
        return "not recorded"
    shown = ", ".join(f"{k} {v}" for k, v in provenance["versions"].items())
    commit = (provenance.get("commit") or "unknown")[:12]
    dirty = " with uncommitted changes" if provenance.get("uncommitted_changes") else ""
    return f"commit {commit}{dirty}; {shown}"


def verify(path: str | Path, updates: int, cache_dir: str) -> tuple[bool, str]:
    """Retrain the first `updates` updates of the run saved at `path` and compare (module docstring). Returns whether
    every record matched, and the report."""
    from ..quiet import quiet
    from .run import run_one

    path = Path(path)
    saved = json.loads(path.read_text())
    task = task_from_settings(saved["settings"]["task"])
    arm = saved["arm"]
    if arm not in ARMS:
        raise ValueError(f"the run's arm {arm!r} is not an arm of this checkout ({', '.join(ARMS)})")
    updates = min(updates, task.steps)
    with tempfile.TemporaryDirectory(prefix="verify-") as workdir, quiet():
        rerun = run_one(task, arm, saved["seed"], None, cache_dir, workdir, stop_after=updates)
    comparisons = compare(saved, rerun, updates)
    ok = all(c.equal for c in comparisons)
    lines = [
        f"verify {task.name}/{arm}/seed{saved['seed']}: its first {updates} updates retrained",
        f"  the run:     {_versions(saved.get('provenance'))}",
        f"  retrained:   {_versions(rerun['provenance'])}",
        *[c.line() for c in comparisons],
        f"verify: {'every record matches' if ok else 'MISMATCH'} ({path})",
    ]
    return ok, "\n".join(lines)
