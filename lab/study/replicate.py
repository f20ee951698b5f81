"""`python -m lab.study --replicate SETTING --seeds 25-27`: a registered setting's arms trained again at fresh seeds,
on this machine, from the shipped warm start, and read against the registered runs.

The runs train like any study run (child processes, one thread each, resumable: a saved run is not trained again) into
`RESULTS/SETTING/ARM/seedN.json`, each recording its machine and commit. Then, per arm and per paired comparison the
registered analysis reads (an arm minus GRPO, at equal generated rollouts and at equal updates), the registered
figures over their 5 seeds and where the fresh seeds land:

- each fresh seed against the registered 95% **prediction** interval for one new seed (mean -+ t(0.975, n-1) x sd x
  sqrt(1 + 1/n)): where a single seed of the same experiment falls 95% of the time;
- the fresh seeds' mean against the registered 95% t-interval of the mean.

A fresh seed outside its prediction interval says this machine's runs differ from the registered ones, or that the
registered seeds were unusual; three seeds inside say no more than that they are compatible.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from . import confirm
from .regimes import T_975, equal_rollouts_difference, final_mean, t_interval

DEFAULT_RESULTS = "benchmarks/results/replicate"
USED_SEEDS = range(0, 25)  # the earlier study (0-4 and more) and the registered one (20-24)


def prediction_interval(values: list[float]) -> tuple[float, float] | None:
    """The 95% prediction interval for one more value: mean -+ t(0.975, n - 1) * sd * sqrt(1 + 1/n)."""
    n = len(values)
    if n < 2:
        return None
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = T_975.get(n - 1, 1.96) * sd * math.sqrt(1 + 1 / n)
    return mean - half, mean + half


def _where(value: float, interval: tuple[float, float] | None) -> str:
    if interval is None:
        return "-"
    lo, hi = interval
    return "inside" if lo <= value <= hi else ("BELOW" if value < lo else "ABOVE")


def quantities(records: list[dict]) -> dict[str, dict[int, float]]:
    """name -> seed -> value: each arm's final held-out pass@1, and each arm minus GRPO at equal generated rollouts and
    at equal updates (paired by seed), as the registered analysis reads them."""
    by_arm: dict[str, dict[int, dict]] = {}
    for r in records:
        by_arm.setdefault(r["arm"], {})[r["seed"]] = r
    out: dict[str, dict[int, float]] = {}
    for arm, runs in by_arm.items():
        out[f"{arm}: final held-out pass@1"] = {s: final_mean(r) for s, r in runs.items()}
    grpo = by_arm.get("grpo", {})
    for arm, runs in by_arm.items():
        if arm == "grpo":
            continue
        seeds = sorted(set(runs) & set(grpo))
        out[f"{arm} - grpo, equal generated rollouts"] = {
            s: equal_rollouts_difference(runs[s], grpo[s]) for s in seeds
        }
        out[f"{arm} - grpo, equal updates"] = {s: final_mean(runs[s]) - final_mean(grpo[s]) for s in seeds}
    return out


def _machines(records: list[dict]) -> str:
    seen = sorted({json.dumps((r.get("provenance") or {}).get("machine"), sort_keys=True) for r in records})
    words = []
    for m in map(json.loads, seen):
        words.append("not recorded" if not m else f"{m['cpu']}, {m['capability']} kernels, {m['threads']} thread(s)")
    return "; ".join(words) or "-"


def reading(setting: str, registered: list[dict], fresh: list[dict]) -> tuple[dict[str, Any], str]:
    """The fresh runs of `setting` against the registered ones (module docstring): a JSON-able payload and markdown."""
    reg, new = quantities(registered), quantities(fresh)
    rows = []
    for name, by_seed in reg.items():
        values = list(by_seed.values())
        mean_ci, pred = t_interval(values), prediction_interval(values)
        got = new.get(name, {})
        fresh_mean = statistics.fmean(got.values()) if got else None
        rows.append({
            "quantity": name,
            "registered": {"seeds": sorted(by_seed), "mean": statistics.fmean(values), "ci95_mean": mean_ci,
                           "prediction95": pred, "min": min(values), "max": max(values)},
            "fresh": {str(s): {"value": v, "against_prediction": _where(v, pred)} for s, v in sorted(got.items())},
            "fresh_mean": fresh_mean,
            "fresh_mean_against_ci": None if fresh_mean is None or mean_ci is None else _where(fresh_mean, mean_ci),
        })  # fmt: skip
    seeds = sorted({r["seed"] for r in fresh})
    commits = sorted({((r.get("provenance") or {}).get("commit") or "?")[:12] for r in fresh})
    lines = [
        f"## {setting}: {len(seeds)} fresh seed(s) ({', '.join(map(str, seeds)) or 'none yet'}) against the "
        f"registered runs (seeds {', '.join(map(str, sorted({r['seed'] for r in registered})))})",
        "",
        f"Machines: the registered runs {_machines(registered)}; the fresh runs {_machines(fresh)}. Commits of the "
        f"fresh runs: {', '.join(commits) or '-'}.",
        "",
        "| quantity | registered mean [95% CI of the mean] | registered 95% prediction interval (one seed) | "
        "registered min to max | fresh seeds (against the prediction interval) | fresh mean (against the CI) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = row["registered"]
        f = "{:+.3f}".format if " - " in row["quantity"] else "{:.3f}".format  # a difference has a sign
        ci = f" [{f(r['ci95_mean'][0])}, {f(r['ci95_mean'][1])}]" if r["ci95_mean"] else ""
        pred = f"[{f(r['prediction95'][0])}, {f(r['prediction95'][1])}]" if r["prediction95"] else "-"
        fresh = ", ".join(f"{s}: {f(v['value'])} {v['against_prediction']}" for s, v in row["fresh"].items())
        mean = "-" if row["fresh_mean"] is None else f"{f(row['fresh_mean'])} {row['fresh_mean_against_ci']}"
        lines.append(f"| {row['quantity']} | {f(r['mean'])}{ci} | {pred} | {f(r['min'])} to {f(r['max'])} | "
                     f"{fresh or 'not run yet'} | {mean} |")  # fmt: skip
    outside = [f"{row['quantity']} seed {s}" for row in rows for s, v in row["fresh"].items()
               if v["against_prediction"] != "inside"]  # fmt: skip
    lines += [
        "",
        ("Every fresh seed lies inside the registered prediction interval of its quantity: compatible with the "
         "registered runs (three seeds cannot show more)." if not outside else
         f"Outside the registered prediction interval: {'; '.join(outside)}.") if any(r["fresh"] for r in rows)
        else "No fresh run is in yet.",
    ]  # fmt: skip
    return {"setting": setting, "seeds": seeds, "rows": rows}, "\n".join(lines)


def check_seeds(seeds: list[int]) -> None:
    """ValueError for a seed an earlier study or the registered one used (a replication is at fresh seeds)."""
    used = [s for s in seeds if s in USED_SEEDS]
    if used:
        raise ValueError(
            f"--seeds: seed {used[0]} was used by the registered study (20-24) or the earlier ones (0-19); a "
            "replication trains fresh seeds (25 and up); --verify retrains a registered run"
        )


def write(results: Path, setting: str, registered_root: Path = Path(confirm.RESULTS)) -> str:
    """Read `setting`'s fresh runs in `results` against the registered ones; writes RESULTS/SETTING/replication.md
    and .json, returns the markdown."""
    registered = [r for r in confirm.load_runs(registered_root) if r["task"] == setting]
    fresh = [json.loads(p.read_text()) for p in sorted((Path(results) / setting).glob("*/seed*.json"))]
    payload, text = reading(setting, registered, fresh)
    folder = Path(results) / setting
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "replication.json").write_text(json.dumps(payload, indent=1) + "\n")
    (folder / "replication.md").write_text(text + "\n")
    return text
