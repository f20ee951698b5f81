"""`python -m lab.study --verify RUN.json --updates 50`: retrain the first updates of a saved run and compare what the
analysis reads.

In order:

1. **The settings** the run recorded against the task and arm as this checkout defines them (with the call's `--quick`
   and `--set`): a task definition changed since the run fails here, and nothing is retrained.
2. **The machine**: the run's (CPU model, the kernels torch picked, threads; `lab.warm_start.machine`) against this
   one. On the same machine a run is deterministic (one thread), so every record must be equal, not close. On another
   machine, or for a run that recorded none (runs made before machines were recorded), the per-update figures are
   expected to differ (a last-bit difference in a CPU kernel grows over updates): what must still be equal decides -
   the identity of what it trained from (warm-start weights, training pool, held-out set), the fully resolved config
   and the settings - and the records are counted, not listed.
3. **The code**: the run's commit against this checkout (how many commits and which files under `exgrpo_trl/` and
   `lab/` changed since), shown, not compared: it says where to look when something differs.
4. **The records**: every held-out evaluation up to `updates`, every per-update record, every generation batch's
   record that finished by then and, when `updates` reaches the run's length, the final evaluations (the figures the
   analysis averages) and end-of-run counts.

A block in which nothing was compared is a failure (say, `--updates` too short for one generation batch to finish).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from .tasks import ARMS, Task

DECISIVE_ELSEWHERE = ("identity", "config", "settings")  # what must be equal on any machine


def _setting_defaults() -> dict[str, Any]:
    """Every ExGRPO setting's default: a setting added after a run was made, at its default, trains as the run did."""
    from exgrpo_trl.settings import settings_fields

    return {f.name: f.default for f in settings_fields()}


@dataclasses.dataclass
class Comparison:
    """One kind of record: how many values were compared and the differences found (at most a few are kept)."""

    key: str
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
        return self.compared > 0 and not self.differences

    def line(self, decisive: bool = True) -> str:
        if self.compared == 0:
            return f"  {self.what}: NOTHING COMPARED"
        if not self.differences:
            return f"  {self.what}: {self.compared} equal"
        n = len(self.differences) + self.missing
        if not decisive:  # another machine: a count and the first difference
            return f"  {self.what}: {n} of {self.compared} differ (expected here)\n      first: {self.differences[0]}"
        more = f" (and {self.missing} more)" if self.missing else ""
        shown = "\n      ".join(self.differences)
        return f"  {self.what}: {n} of {self.compared} DIFFER{more}\n      {shown}"


def compare_settings(saved: dict[str, Any], today: dict[str, Any]) -> Comparison:
    """The run's recorded settings, field by field, against `today` (`run.run_settings` of this checkout)."""
    out = Comparison("settings", "settings against the task and arm as this checkout defines them")
    for part in ("task", "arm", "trainer", "config"):
        made, now = saved.get(part, "<absent>"), today[part]
        if isinstance(made, dict) and isinstance(now, dict):
            for key in sorted(set(made) | set(now)):
                out.check(f"settings.{part}.{key}", made.get(key, "<absent>"), now.get(key, "<absent>"))
        else:
            out.check(f"settings.{part}", made, now)
    return out


def compare(saved: dict[str, Any], rerun: dict[str, Any], updates: int, *, final: bool) -> list[Comparison]:
    """Every record of `rerun` (the first `updates` updates retrained; the whole run with `final`) against the same
    records of `saved`: the identity and config (when the run recorded its provenance), then the records."""
    rerun = json.loads(json.dumps(rerun))  # as a saved JSON holds it
    out = []
    made, remade = saved.get("provenance"), rerun["provenance"]
    if made is not None:
        identity = Comparison("identity", "warm start, training pool, held-out set (sha256)")
        for key in ("warm_start_sha256", "train_pool_sha256", "held_out_sha256"):
            identity.check(key, made.get(key), remade.get(key))
        out.append(identity)
        # a setting added since the run, at its default, is how the run trained: named, not a difference
        defaults = _setting_defaults()
        added = {k for k, v in remade["config"].items() if k not in made["config"] and k in defaults
                 and v == defaults[k]}  # fmt: skip
        config = Comparison("config", "resolved config fields" + (
            f" (added since the run, at their defaults: {', '.join(sorted(added))})" if added else ""))  # fmt: skip
        for key in sorted((set(made["config"]) | set(remade["config"])) - added):
            config.check(f"config.{key}", made["config"].get(key, "<absent>"), remade["config"].get(key, "<absent>"))
        out.append(config)

    curve = Comparison("curve", f"held-out evaluations up to update {updates}")
    for i, step in enumerate(saved["curve"]["step"]):
        if step > updates:
            break
        for key in ("step", "rollouts", "pass_at_1"):
            curve.check(f"curve.{key}[{i}] (update {step})", saved["curve"][key][i], _at(rerun["curve"][key], i))
        for d, values in saved["curve"]["by_difficulty"].items():
            got = _at(rerun["curve"]["by_difficulty"].get(d, []), i)
            curve.check(f"curve.by_difficulty[{d}][{i}] (update {step})", values[i], got)
    out.append(curve)

    steps = Comparison("steps", f"per-update records, updates 1-{updates}")
    for key, values in saved["steps"].items():
        for i, value in enumerate(values[:updates]):
            steps.check(f"steps.{key}[{i}] (update {i + 1})", value, _at(rerun["steps"].get(key, []), i))
    out.append(steps)

    spg = saved["settings"]["task"].get("steps_per_generation", 1)
    batches = Comparison("batches", f"generation-batch records finished by update {updates}")
    rerun_batches = {b["step"]: b for b in rerun.get("batches", [])}
    for b in saved.get("batches", []):
        if b["step"] + spg > updates:  # its last update (and its importance weights) falls later
            continue
        other = rerun_batches.get(b["step"], {})
        for key, value in b.items():
            batches.check(f"batches[update {b['step']}].{key}", value, other.get(key, "<absent>"))
    out.append(batches)

    if final:
        ending = Comparison("final", "final evaluations (what the analysis averages) and end-of-run counts")
        for part in ("final", "questions", "replay_counts"):
            for key, where, value in _leaves(saved.get(part, {}), part):
                ending.check(where, value, _lookup(rerun.get(part, {}), key))
        out.append(ending)
    return out


def _leaves(value: Any, where: str, key: tuple = ()) -> list[tuple[tuple, str, Any]]:
    """Every scalar inside `value` (dicts and lists walked), with its path."""
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{where}.{k}", (*key, k))]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{where}[{i}]", (*key, i))]
    return [(key, where, value)]


def _lookup(value: Any, key: tuple) -> Any:
    for k in key:
        try:
            value = value[k]
        except (KeyError, IndexError, TypeError):
            return "<absent>"
    return value


def _at(values: list, i: int) -> Any:
    return values[i] if i < len(values) else "<absent>"


def _versions(provenance: dict[str, Any] | None) -> str:
    if not provenance:
        return "not recorded"
    shown = ", ".join(f"{k} {v}" for k, v in provenance["versions"].items())
    commit = (provenance.get("commit") or "unknown")[:12]
    dirty = " with uncommitted changes" if provenance.get("uncommitted_changes") else ""
    return f"commit {commit}{dirty}; {shown}"


def _machine_words(m: dict[str, Any] | None) -> str:
    if not m:
        return "not recorded"
    return f"{m.get('cpu')}, {m.get('capability')} kernels, {m.get('threads')} thread(s)"


def machine_relation(made: dict[str, Any] | None, here: dict[str, Any]) -> str:
    """ "same", "different" or "not recorded": the run's machine (CPU model, kernels, threads) against this one."""
    if not made:
        return "not recorded"
    same = all(made.get(k) == here.get(k) for k in ("cpu", "capability", "threads"))
    return "same" if same else "different"


def code_since(commit: str | None) -> str:
    """The code between a run's commit and this checkout, in one line (shown, not compared)."""
    from .provenance import LAB_ROOT, _git, git_state

    here = git_state(LAB_ROOT)
    if not commit or here["commit"] is None:
        return "not known (the run or this checkout has no commit)"
    if commit == here["commit"]:
        dirty = f", with uncommitted changes to {len(here['dirty'])} file(s)" if here["dirty"] else ""
        return f"the run's commit {commit[:12]}{dirty}"
    count = _git(LAB_ROOT, "rev-list", "--count", f"{commit}..HEAD")
    if count is None:
        return f"the run's commit {commit[:12]} is not in this clone's history"
    files = (_git(LAB_ROOT, "diff", "--name-only", commit, "HEAD", "--", "exgrpo_trl", "lab") or "").split()
    shown = ", ".join(files[:6]) + (f" and {len(files) - 6} more" if len(files) > 6 else "")
    return (f"{count.strip()} commit(s) after the run's {commit[:12]}; {len(files)} file(s) under exgrpo_trl/ and "
            f"lab/ changed since{': ' + shown if files else ''}")  # fmt: skip


def verify(path: str | Path, updates: int, cache_dir: str, tasks: dict[str, Task]) -> tuple[bool, str]:
    """Retrain the first `updates` updates of the run saved at `path` with its task from `tasks` (this checkout's
    definitions, the call's --quick and --set applied) and compare (module docstring). Returns whether what decides
    matched, and the report."""
    import torch

    from ..quiet import quiet
    from ..warm_start import machine
    from .run import run_one, run_settings

    path = Path(path)
    saved = json.loads(path.read_text())
    name, arm, seed = saved["settings"]["task"]["name"], saved["arm"], saved["seed"]
    if name not in tasks:
        raise ValueError(f"the run's task {name!r} is not a task of this checkout ({', '.join(tasks)})")
    if arm not in ARMS:
        raise ValueError(f"the run's arm {arm!r} is not an arm of this checkout ({', '.join(ARMS)})")
    task = tasks[name]
    made = saved.get("provenance") or {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what run_one trains with: the machine as a run records it
    try:
        here = machine()
    finally:
        torch.set_num_threads(threads)
    relation = machine_relation(made.get("machine"), here)
    lines = [
        f"verify {name}/{arm}/seed{seed} ({path})",
        f"  machine:     the run's {_machine_words(made.get('machine'))}; here {_machine_words(here)}"
        + {
            "same": " (the same: every record must be equal)",
            "different": " (DIFFERENT: per-update records are expected to differ; the hashes, config and settings "
            "decide)",
            "not recorded": " (the run records none: the records cannot tell another CPU's kernels from a change in "
            "code; the hashes, config and settings decide)",
        }[relation],  # fmt: skip
        f"  code:        {code_since(made.get('commit'))}",
        f"  the run:     {_versions(made)}",
    ]
    settings = compare_settings(saved["settings"], run_settings(task, arm, seed))
    if not settings.equal:
        lines += [settings.line(), "verify: MISMATCH (the settings; nothing retrained: give the run's --quick and "
                  "--set, or the task's definition changed since the run)"]  # fmt: skip
        return False, "\n".join(lines)
    updates = min(updates, task.steps)
    final = updates >= task.steps
    with tempfile.TemporaryDirectory(prefix="verify-") as workdir, quiet():
        rerun = run_one(task, arm, seed, None, cache_dir, workdir, stop_after=updates)
    comparisons = [settings, *compare(saved, rerun, updates, final=final)]
    decisive = [c for c in comparisons if relation == "same" or c.key in DECISIVE_ELSEWHERE]
    records = [c for c in comparisons if c not in decisive]
    scope = ", final evaluations included" if final else f" (the final evaluations need --updates {task.steps})"
    lines += [
        f"  retrained:   {_versions(rerun['provenance'])}",
        f"  retrained:   the first {updates} of its {task.steps} updates{scope}",
    ]
    lines += [c.line(decisive=c in decisive) for c in comparisons]
    ok = all(c.equal for c in decisive) and all(c.compared for c in comparisons)
    if not ok:
        verdict = "MISMATCH"
    elif all(c.equal for c in records):
        verdict = "every record matches"
    else:
        differ = sum(len(c.differences) + c.missing for c in records)
        why = "another machine" if relation == "different" else "a machine the run did not record"
        verdict = (f"the hashes, config and settings match; {differ} of {sum(c.compared for c in records)} records "
                   f"differ, not decisive on {why}")  # fmt: skip
    lines.append(f"verify: {verdict} ({path})")
    return ok, "\n".join(lines)
