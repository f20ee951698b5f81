"""The registered study's machinery: provenance in every run, the refusal of an uncommitted tree, `--verify`, the
registered order and the analysis's tests and correction (p-values derived by hand in the comments)."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab import study
from lab.study import confirm, provenance, stats
from lab.study import run as study_run
from lab.tests.records import arm_records


# ------------------------------------------------------------------------------------------------ statistics
def test_t_distribution_by_hand():
    # df = 4 (A&S 26.7.4): theta = atan(t / 2), P(|T| <= t) = sin(theta) (1 + cos^2(theta) / 2). At t = 2:
    # sin = 2 / sqrt(8) = 0.707107, cos^2 = 1/2 -> A = 0.883883, P(T <= 2) = 0.941942.
    assert stats.t_cdf(2.0, 4) == pytest.approx(0.941942, abs=1e-6)
    assert stats.t_cdf(-2.0, 4) == pytest.approx(1 - 0.941942, abs=1e-6)
    # df = 1 is Cauchy: P(T <= 1) = 1/2 + atan(1) / pi = 0.75; df = 3 (odd series): at t = sqrt(3), theta = pi/4,
    # A = (2/pi)(pi/4 + sin cos) = (2/pi)(0.785398 + 0.5) = 0.818310, P = 0.909155.
    assert stats.t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)
    assert stats.t_cdf(math.sqrt(3), 3) == pytest.approx(0.909155, abs=1e-6)
    # the table's 97.5% points
    for df, t in ((1, 12.706), (4, 2.776), (10, 2.228)):
        assert stats.t_cdf(t, df) == pytest.approx(0.975, abs=2e-5)


def test_paired_tests_by_hand():
    values = [0.01, 0.02, 0.03, 0.04, 0.05]
    # mean 0.03, sd sqrt(0.00025) = 0.0158114, se 0.00707107, t = 4.24264; df 4: sin(theta) = 4.24264 / sqrt(22)
    # = 0.904534, cos^2 = 4/22 -> A = 0.904534 * (1 + 2/22) = 0.986764 -> two-sided p = 1 - A = 0.013236
    assert stats.t_test_p(values) == pytest.approx(0.013236, abs=1e-6)
    # non-inferiority by 0.01: t = (0.03 + 0.01) / 0.00707107 = 5.65685; sin = 5.65685 / 6 = 0.942809, cos^2 = 1/9
    # -> A = 0.942809 * (1 + 1/18) = 0.995187, P(T <= t) = 0.997593 -> one-sided p = 0.002407
    assert stats.noninferiority_p(values, 0.01) == pytest.approx(0.002407, abs=1e-6)
    # sign-flip: all five positive, only the all-plus and all-minus patterns reach |sum| 0.15: 2 / 32
    assert stats.sign_flip_p(values) == 2 / 32
    assert stats.sign_flip_p(values, shift=0.01, two_sided=False) == 1 / 32  # the smallest one-sided p with 5
    # [0.02, -0.01, 0.03]: sum 0.04; the 8 sign patterns of (0.02, 0.01, 0.03) sum to +-0.06, +-0.04, +-0.02, 0, 0:
    # |sum| >= 0.04 for 4 of 8
    assert stats.sign_flip_p([0.02, -0.01, 0.03]) == 0.5
    assert stats.t_test_p([0.02]) is None and stats.t_test_p([0.01, 0.01]) == 0.0  # no spread: t infinite


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04 of m = 3: 3 * 0.01 = 0.03, 2 * 0.03 = 0.06, 1 * 0.04 -> max(0.06, 0.04) = 0.06;
    # None is not a member of the family
    assert stats.holm([0.01, 0.04, 0.03, None]) == pytest.approx([0.03, 0.06, 0.06, None])
    assert stats.holm([0.6, 0.5]) == [1.0, 1.0]  # capped at 1


# ------------------------------------------------------------------------------------------------ the plan
def test_registered_order_pairs_first_then_exgrpo():
    order = confirm.registered_order()
    assert len(order) == len(set(order)) == 60
    assert order[:4] == [("addition", "grpo", 20), ("addition", "reuse_limit", 20), ("addition", "grpo", 21),
                         ("addition", "reuse_limit", 21)]  # fmt: skip
    assert {a for _, a, _ in order[:40]} == {"grpo", "reuse_limit"} and {a for _, a, _ in order[40:]} == {"exgrpo"}
    assert [t for t, _, _ in order[::10]] == [*confirm.SETTINGS, "addition", "countdown-paper-lr2.5e-5"]
    assert all(t in study.TASKS and a in study.ARMS for t, a, _ in order)
    assert study.ARMS["reuse_limit"].exgrpo["replay_cooldown"] == 9


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def _repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    (root / "tracked.txt").write_text("a\n")
    _git(root, "add", "tracked.txt")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "x")
    return root


def test_a_confirmatory_run_refuses_uncommitted_changes(tmp_path, monkeypatch, capsys):
    root = _repo(tmp_path)
    (root / "untracked.json").write_text("{}")  # runs being written are untracked: allowed
    state = provenance.require_clean(root)
    assert len(state["commit"]) == 40 and state["dirty"] == []
    (root / "tracked.txt").write_text("b\n")
    with pytest.raises(provenance.DirtyTree, match="uncommitted changes to tracked files \\(tracked.txt\\)"):
        provenance.require_clean(root)
    with pytest.raises(provenance.DirtyTree, match="not a git checkout"):
        provenance.require_clean(tmp_path / "elsewhere")
    # a run refuses before loading anything, and so does the registered study's command (one line, exit 2)
    monkeypatch.setattr(provenance, "LAB_ROOT", root)
    task = study.build_tasks(True)["addition"]
    with pytest.raises(provenance.DirtyTree):
        study_run.run_one(task, "grpo", 0, None, str(tmp_path / "cache"), str(tmp_path / "w"), confirmatory=True)
    assert not (tmp_path / "cache").exists()
    for flag in ("--confirm", "--policies"):
        assert study.main([flag, "--results", str(tmp_path / "results")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag}: uncommitted changes to tracked files" in err


@pytest.mark.parametrize("shrink", [["--quick"], ["--set", "steps=10"]], ids=["quick", "set"])
def test_the_registered_study_is_not_shrunk(tmp_path, monkeypatch, capsys, shrink):
    """--confirm with --quick or --set is refused by its own rule, on a clean tree with nothing run yet (where
    without the rule the study would start training: that start fails this test instead)."""
    from lab.study import cli

    monkeypatch.setattr(provenance, "LAB_ROOT", _repo(tmp_path))
    monkeypatch.setattr(cli, "run_missing", lambda *a: pytest.fail("the registered study started training"))
    assert study.main(["--confirm", "--results", str(tmp_path / "results"), *shrink]) == 2
    assert capsys.readouterr().err == (
        "lab.study: --confirm runs the registered settings as they are: no --quick or --set\n"
    )


def test_one_commit_per_registered_study(tmp_path):
    results = tmp_path / "confirm"
    path = results / "addition" / "grpo" / "seed20.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"provenance": {"commit": "a" * 40}}))
    confirm.check_one_commit(results, "a" * 40)
    with pytest.raises(ValueError, match=f"runs made by commit {'a' * 40} \\(1, e.g. addition/grpo/seed20.json\\)"):
        confirm.check_one_commit(results, "b" * 40)


@pytest.mark.parametrize("folder", ["confirm", "policies"])
def test_the_committed_runs_and_the_plan_above_its_line_are_the_registered_commit(folder):
    """Every committed run of a registered study records one commit; plan.md's text above its notes line is that
    commit's plan, unchanged (later notes only below it). Needs the commit in this clone's history (not in a shallow
    clone)."""
    repo = provenance.LAB_ROOT
    root = repo / "benchmarks" / "results" / folder
    commits = {json.loads(p.read_text())["provenance"]["commit"] for p in root.glob("*/*/seed*.json")}
    assert len(commits) == 1, commits
    commit = commits.pop()
    line = "Notes added after the runs began"
    registered = subprocess.run(["git", "show", f"{commit}:benchmarks/results/{folder}/plan.md"], cwd=repo,
                                capture_output=True, text=True)  # fmt: skip
    if registered.returncode != 0:
        pytest.skip(f"commit {commit[:12]} is not in this clone's history")
    now = (root / "plan.md").read_text()
    assert now.split(line)[0] == registered.stdout.split(line)[0]
    assert now.startswith(registered.stdout.rstrip("\n"))  # the notes are added at the end


# ------------------------------------------------------------------------------------------------ provenance, verify
def test_provenance_fields_and_verify_on_a_tiny_run(tmp_path, capsys, monkeypatch):
    # The warm start is built in a fresh cache folder (not the study's): --quick's 5-step warm start ships nowhere.
    results, cache = tmp_path / "results", tmp_path / "cache"
    argv = ["--quick", "--tasks", "addition", "--arms", "exgrpo", "--seeds", "0", "--results", str(results),
            "--cache-dir", str(cache), "--no-progress", "--jobs", "1"]  # fmt: skip
    assert study.main(argv) == 0
    assert len(list(cache.glob("warm-start-5steps-seed0-*"))) == 1
    path = results / "addition" / "exgrpo" / "seed0.json"
    made = json.loads(path.read_text())["provenance"]
    assert len(made["commit"]) == 40 and isinstance(made["uncommitted_changes"], list)
    assert made["confirmatory"] is False
    assert set(made["versions"]) == {"python", "torch", "trl", "transformers", "accelerate", "datasets", "numpy"}
    import torch

    assert made["machine"]["capability"] == torch.backends.cpu.get_cpu_capability() and made["machine"]["threads"] == 1
    assert made["machine"]["cpu"]
    for key in ("warm_start_sha256", "train_pool_sha256", "held_out_sha256"):
        assert len(made[key]) == 64
    config = made["config"]  # every field, resolved: defaults the run never set included, no machine paths
    assert config["replay_cooldown"] == 0 and config["replay_ratio"] == 0.5 and config["max_steps"] == 2
    assert config["max_trajectory_candidates"] is None and "output_dir" not in config and len(config) > 150
    capsys.readouterr()

    verify = ["--quick", "--cache-dir", str(cache), "--verify"]
    assert study.main([*verify, str(path)]) == 0
    out = capsys.readouterr().out
    assert "the first 2 of its 2 updates, final evaluations included" in out and "verify: every record matches" in out
    assert "per-update records, updates 1-2: 14 equal" in out  # 7 series x 2 updates
    assert "warm start, training pool, held-out set (sha256): 3 equal" in out
    # final: pass_at_1, rollouts, 4 digit buckets, 2 resampled (QUICK_SWEEP's 2 seeds are for the big tasks: addition
    # evaluates once, so 1 resampled), questions (4 counts), replay_counts (4 + its histogram's entries)
    assert "final evaluations (what the analysis averages) and end-of-run counts:" in out
    assert "(the same: every record must be equal)" in out and "the run's commit" in out
    assert "NOTHING COMPARED" not in out

    def altered(name, change):
        record = json.loads(path.read_text())
        change(record)
        bad = tmp_path / f"{name}.json"
        bad.write_text(json.dumps(record))
        return bad

    # a per-update figure changed: named, exit 1
    bad = altered("step", lambda r: r["steps"]["batch_pass_at_1"].__setitem__(1, 0.5))
    assert study.main([*verify, str(bad)]) == 1
    out = capsys.readouterr().out
    assert "per-update records, updates 1-2: 1 of 14 DIFFER" in out and "verify: MISMATCH" in out
    assert "steps.batch_pass_at_1[1] (update 2): saved 0.5, retrained" in out
    # a final evaluation changed: the analysis reads it, so verify does
    bad = altered("final", lambda r: r["final"]["pass_at_1_resampled"].__setitem__(0, 0.123))
    assert study.main([*verify, str(bad)]) == 1
    assert "final.pass_at_1_resampled[0]: saved 0.123, retrained" in capsys.readouterr().out
    # the same run on another machine: the records are counted, not decisive; the hashes, config and settings decide
    other = {"cpu": "Another CPU", "capability": "AVX2", "threads": 1}
    bad = altered("machine", lambda r: (r["provenance"].__setitem__("machine", other),
                                        r["steps"]["batch_pass_at_1"].__setitem__(1, 0.5)))  # fmt: skip
    assert study.main([*verify, str(bad)]) == 0
    out = capsys.readouterr().out
    assert "the run's Another CPU, AVX2 kernels, 1 thread(s)" in out and "(DIFFERENT: per-update" in out
    assert "per-update records, updates 1-2: 1 of 14 differ (expected here)" in out
    assert "verify: the hashes, config and settings match; 1 of" in out and "not decisive on another machine" in out
    # ... but a warm start that is not the run's fails there too
    bad = altered("weights", lambda r: (r["provenance"].__setitem__("machine", other),
                                        r["provenance"].__setitem__("warm_start_sha256", "0" * 64)))  # fmt: skip
    assert study.main([*verify, str(bad)]) == 1
    assert "warm_start_sha256: saved '0000" in capsys.readouterr().out
    # a run made before machines were recorded: said so, the records not decisive
    bad = altered("old", lambda r: r["provenance"].pop("machine"))
    assert study.main([*verify, str(bad)]) == 0
    assert "the run's not recorded" in capsys.readouterr().out
    # a run made before a setting existed: the setting at its default is how it trained, named and not a difference;
    # at another value it is one
    bad = altered("older", lambda r: r["provenance"]["config"].pop("replay_max_age"))
    assert study.main([*verify, str(bad)]) == 0
    out = capsys.readouterr().out
    assert "resolved config fields (added since the run, at their defaults: replay_max_age): " in out
    bad = altered("changed", lambda r: r["provenance"]["config"].__setitem__("replay_priority", "advantage"))
    assert study.main([*verify, str(bad)]) == 1
    assert "config.replay_priority: saved 'advantage', retrained 'gaussian'" in capsys.readouterr().out
    # the task's definition today differs from the run's (here: verified without the run's --quick): nothing retrained
    monkeypatch.setattr(study_run, "run_one", lambda *a, **k: pytest.fail("retrained with other settings"))
    assert study.main(["--cache-dir", str(cache), "--verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "settings.task.steps: saved 2, retrained 300" in out and "verify: MISMATCH (the settings" in out


def test_verify_fails_an_empty_comparison():
    # nothing finished by update 1 of a 2-update generation batch: the batches block compared nothing, a failure
    from lab.study.verify import Comparison, compare

    curve = {"step": [0], "rollouts": [0], "pass_at_1": [0.5], "by_difficulty": {}}
    saved = {"settings": {"task": {"steps_per_generation": 2}}, "curve": curve, "steps": {"rollouts": [8, 8]},
             "batches": [{"step": 0}]}  # fmt: skip
    rerun = {**saved, "provenance": {}}
    blocks = {c.key: c for c in compare(saved, rerun, 1, final=False)}
    assert blocks["curve"].equal and blocks["steps"].equal
    assert blocks["batches"].compared == 0 and not blocks["batches"].equal
    assert "NOTHING COMPARED" in blocks["batches"].line()
    assert not Comparison("x", "y").equal


# ------------------------------------------------------------------------------------------------ analysis
def _runs(setting, finals_by_arm, batches_by_arm=None):
    return arm_records(setting, finals_by_arm, confirm.SEEDS, batches_by_arm)


def test_analysis_by_hand(tmp_path):
    grpo = [0.30, 0.31, 0.32, 0.33, 0.34]
    limit = [0.31, 0.33, 0.35, 0.37, 0.39]  # + 0.01, 0.02, 0.03, 0.04, 0.05 at equal updates
    exgrpo = [0.29, 0.30, 0.31, 0.32, 0.33]  # - 0.01 each: no spread
    batches = {
        "reuse_limit": [{"reuse": 1.0, "repeat_share": 0.0}, {"reuse": 2.0, "repeat_share": 0.0}],
        "exgrpo": [{"reuse": 3.0, "repeat_share": 0.5}, {"reuse": None}, {"reuse": 7.0, "repeat_share": 1.0}],
    }
    runs = _runs("countdown-hard", {"grpo": grpo, "reuse_limit": limit, "exgrpo": exgrpo}, batches)  # fmt: skip
    for r in runs:
        path = tmp_path / r["task"] / r["arm"] / f"seed{r['seed']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))
    payload, text = confirm.analyse(tmp_path)
    rows = {(c["arm"], c["base"], c["axis"]): c for c in payload["comparisons"] if c["setting"] == "countdown-hard"}

    updates = rows[("reuse_limit", "grpo", "final_updates")]
    assert updates["mean"] == pytest.approx(0.03) and updates["p_t"] == pytest.approx(0.013236, abs=1e-6)
    assert updates["p_sign_flip"] == 2 / 32 and updates["p_noninferior"] == pytest.approx(0.002407, abs=1e-6)
    # equal rollouts: GRPO read at 950 of its 1000 rollouts, 0.2 + 0.95 (final - 0.2): the differences are
    # limit - grpo + 0.05 (grpo - 0.2) = 0.01 + 0.005, 0.02 + 0.0055, ... -> mean 0.03 + 0.0060 = 0.0360
    rollouts = rows[("reuse_limit", "grpo", "final_rollouts")]
    assert rollouts["mean"] == pytest.approx(0.036) and rollouts["n"] == 5
    # the primary family has 2 members with data (this one setting): Holm doubles the smaller p
    assert updates["p_t_holm"] == pytest.approx(max(2 * min(updates["p_t"], rollouts["p_t"]), updates["p_t"]))
    assert updates["verdict"] == "above" and updates["p_t_holm"] < 0.05
    # exgrpo - grpo: -0.01 on every seed at equal updates (up to rounding): p about 0; in the secondary family
    below = rows[("exgrpo", "grpo", "final_updates")]
    assert below["p_t"] < 1e-6 and below["verdict"] == "below" and below["family"] == "secondary"
    assert rows[("exgrpo", "grpo", "auc_updates")]["family"] == "descriptive"
    # concentration: the median over seeds of each run's mean and last reuse (every seed the same here)
    conc = {c["arm"]: c for c in payload["concentration"]}
    assert (conc["exgrpo"]["reuse_mean"], conc["exgrpo"]["reuse_end"], conc["exgrpo"]["repeat_share_mean"]) == (
        5.0, 7.0, 0.75)  # fmt: skip
    assert (conc["reuse_limit"]["reuse_mean"], conc["reuse_limit"]["reuse_end"]) == (1.5, 2.0) and "grpo" not in conc
    assert len(payload["missing"]) == 60 - 15 and "Runs in: 15 of 60" in text
    # the answer for a user: GRPO's median final 0.32; at equal rollouts ExGRPO's differences are -0.01 + 0.05 (g -
    # 0.2) = -0.005 ... -0.003 (mean -0.004, sd 0.00079, half-width 2.776 x 0.00035 = 0.0010), the limit's 0.015 ...
    # 0.057 (mean 0.036, sd 0.0166, half-width 0.0206); at equal updates ExGRPO's are -0.010 on every seed (sd ~0) and
    # the limit's 0.01 ... 0.05 (mean 0.030, sd 0.0158, half-width 2.776 x 0.0158 / sqrt(5) = 0.0196)
    row = ("| 0.320 | -0.004 [-0.005, -0.003], below / -0.010 [-0.010, -0.010], below (5 seeds) | +0.036 [+0.015, "
           "+0.057], above / +0.030 [+0.010, +0.050], above (5 seeds) |")  # fmt: skip
    assert row in text and "never solved" in text
    assert (tmp_path / "analysis.md").read_text() == text


def test_the_registered_answer_in_the_plans_words():
    """`confirm.answer` writes each outcome as plan.md's "What will be written for each outcome" says. Every setting
    has GRPO at 0.30 ... 0.34 (seeds 20-24); the replaying arms generate 950 rollouts to GRPO's 1000, so at equal
    rollouts GRPO is read at 0.2 + 0.95 (g - 0.2): a replaying arm's difference gains 0.05 (g - 0.2) = +0.005 ...
    +0.007.
    - addition: the limit -0.05 and ExGRPO -0.10 on every seed: below GRPO on both axes, the limit above ExGRPO
      (+0.05);
    - countdown-weak: the limit +0.001, -0.001, 0, +0.002, -0.002 (sd 0.0016): level at equal updates (t of the loss
      of 0.01 = 0.01 / (0.0016 / sqrt 5) = 14), above at equal rollouts (+0.006 a seed, t about 8); ExGRPO -0.03 a
      seed, so the limit is above ExGRPO: "removes ExGRPO's loss" at equal updates only;
    - countdown-paper: the limit -0.03, +0.03, -0.02, +0.02, 0 and ExGRPO the opposite signs: nothing resolved;
    - countdown-hard: the limit +0.02 +- 0.002 (above on both axes), ExGRPO -0.02 (below)."""
    grpo = [0.30, 0.31, 0.32, 0.33, 0.34]
    small = [0.001, -0.001, 0.0, 0.002, -0.002]
    spread = [-0.03, 0.03, -0.02, 0.02, 0.0]

    def shifted(by):
        return [round(g + d, 6) for g, d in zip(grpo, by)]

    runs = [
        *_runs("addition", {"grpo": grpo, "reuse_limit": shifted([-0.05] * 5), "exgrpo": shifted([-0.10] * 5)}),
        *_runs("countdown-weak", {"grpo": grpo, "reuse_limit": shifted(small), "exgrpo": shifted([-0.03] * 5)}),
        *_runs(
            "countdown-paper-lr2.5e-5",
            {"grpo": grpo, "reuse_limit": shifted(spread), "exgrpo": shifted([-d for d in spread])},
        ),  # fmt: skip
        *_runs(
            "countdown-hard",
            {"grpo": grpo, "reuse_limit": shifted([0.02 + d for d in small]), "exgrpo": shifted([-0.02] * 5)},
        ),  # fmt: skip
    ]
    rows = confirm.comparisons(runs)
    verdict = {(c["setting"], c["arm"], c["base"], c["axis"]): c.get("verdict") for c in rows}
    level = "non-inferior (within 0.01)"
    primary = [verdict[(s, "reuse_limit", "grpo", a)] for s in confirm.SETTINGS for a in confirm.AXIS_WORDS]
    assert primary == ["below", "below", "above", level, "not resolved", "not resolved", "above", "above"]
    # the earlier study: ExGRPO above GRPO at addition (+0.05 a seed +- 0.01); nothing else of it was run
    earlier = [c for c in confirm.comparisons(_runs("addition", {"grpo": grpo, "exgrpo": shifted(
        [0.05 + 5 * d for d in small])})) if c["n"]]  # fmt: skip
    addition, weak, paper, hard, claim, advice, against = confirm.answer(rows, earlier)

    assert addition.startswith("**addition**: with the reuse limit, ExGRPO ended below GRPO at both equal generated "
                               "rollouts (-0.044 [")  # -0.05 + 0.005 ... 0.007: mean -0.044 # fmt: skip
    assert "equal updates (-0.050 [-0.050, -0.050], Holm p " in addition
    assert "; the reuse limit is not recommended for settings like this one." in addition
    assert "ExGRPO (the paper's settings) against GRPO: below at both" in addition
    assert "The reuse limit against ExGRPO: above at both equal generated rollouts (+0.050 [" in addition
    assert weak.startswith("**countdown-weak**: with the reuse limit, ExGRPO ended above GRPO at equal generated "
                           "rollouts (+0.006 [")  # fmt: skip
    # mean 0, half-width 2.776 x 0.00158 / sqrt 5 = 0.0020
    # a non-inferiority verdict says it rests on the t-test: the sign-flip p's floor at 5 seeds is 1/32 = 0.031
    assert ("; was level with GRPO (not worse by 0.01 or more) at equal updates (+0.000 [-0.002, +0.002], Holm p of a "
            "loss of 0.01 or more < 0.001, by the t-test: the sign-flip test's p cannot go below 0.031 one-sided at 5 "
            "seeds)" in weak)  # fmt: skip
    assert "; at equal updates it removes ExGRPO's loss there rather than adding a gain over GRPO." in weak
    assert "not recommended" not in weak
    assert ("was not told apart from GRPO, and a loss of 0.01 is not ruled out at both equal generated rollouts "
            in paper)  # fmt: skip
    assert "ExGRPO (the paper's settings) against GRPO: not told apart at both" in paper
    assert hard.startswith("**countdown-hard**: with the reuse limit, ExGRPO ended above GRPO at both")
    assert claim.startswith("**The earlier claim** at countdown-hard, equal generated rollouts: the earlier result "
                            "held on fresh seeds: +0.026 [")  # +0.02 + 0.006 # fmt: skip
    assert advice == ("**`replay_cooldown`**: with the reuse limit below GRPO at equal generated rollouts in "
                      "addition, `replay_cooldown` is an option to try with its measured costs, not a "
                      "recommendation; it ended above GRPO only in countdown-weak at equal generated rollouts; "
                      "countdown-hard at equal generated rollouts; countdown-hard at equal updates.")  # fmt: skip
    # the earlier study's addition interval lay above 0 on both axes, this one's below: two changes of direction
    assert against.count("exgrpo - grpo at addition") == 2 and "earlier +0.050 [" in against
    assert "now -0.100 [-0.100, -0.100] (below with Holm's correction)" in against

    # the same study with the limit below GRPO only at equal updates somewhere, and not above at the hard point
    hard_runs = _runs("countdown-hard", {"grpo": grpo, "reuse_limit": shifted([-0.0065 + d / 10 for d in small]),
                                         "exgrpo": shifted([-0.02] * 5)})  # fmt: skip
    rows = confirm.comparisons([r for r in runs if r["task"] != "countdown-hard"] + hard_runs)
    # equal updates -0.0065 +- 0.0002 (below); equal rollouts -0.0065 + 0.005 ... 0.007 = -0.0015 ... +0.0005: sd
    # 0.0008, mean -0.0005, not resolved superiority; non-inferior
    found = {(c["setting"], c["arm"], c["base"], c["axis"]): c for c in rows}
    assert found[("countdown-hard", "reuse_limit", "grpo", "final_updates")]["verdict"] == "below"
    assert found[("countdown-hard", "reuse_limit", "grpo", "final_rollouts")]["verdict"] == level
    claim = confirm.answer(rows)[4]
    assert (
        "did not hold on fresh seeds, that is, it was not confirmed: ExGRPO with the limit was level with GRPO (not "
        "worse by 0.01 or more) (-0.001 ["
        in claim
        and "], Holm p of a loss of 0.01 or more " in claim
    )
    assert claim.endswith("the docs no longer say that the reuse limit ends above GRPO there.")


def test_study_tables_copies_the_registered_answer_and_tables(tmp_path):
    """scripts/study_tables.py copies analysis.md's answer (a list) and its four tables into the study page's markers,
    and its table for a user into the README's, in a copy of the repository's layout; with no analysis each marker
    says "not in yet" and the README keeps the exploratory table."""
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "scripts").mkdir()
    shutil.copy(root / "scripts" / "study_tables.py", tmp_path / "scripts")
    (tmp_path / "docs").mkdir()
    shutil.copy(root / "docs" / "study.md", tmp_path / "docs")
    shutil.copy(root / "README.md", tmp_path)
    shutil.copytree(root / "benchmarks" / "results" / "study", tmp_path / "benchmarks" / "results" / "study",
                    ignore=shutil.ignore_patterns("*.json", "*.png"), dirs_exist_ok=True)  # fmt: skip
    tables = [sys.executable, str(tmp_path / "scripts" / "study_tables.py")]
    assert subprocess.run(tables, capture_output=True).returncode == 0  # no analysis: every marker says so
    page = (tmp_path / "docs" / "study.md").read_text()
    for name in ("confirm-answer", "confirm-user", "confirm-reuse"):
        assert f"<!-- study:{name} -->\n_Not in yet: the registered runs are training" in page, name
    results = tmp_path / "benchmarks" / "results" / "confirm"
    grpo = [0.30, 0.31, 0.32, 0.33, 0.34]
    for setting in confirm.SETTINGS:  # every setting: the limit -0.05, ExGRPO -0.10 on every seed (all "below")
        finals = {"grpo": grpo, "reuse_limit": [g - 0.05 for g in grpo], "exgrpo": [g - 0.10 for g in grpo]}
        batches = {"exgrpo": [{"reuse": 4.0, "repeat_share": 0.5}], "reuse_limit": [{"reuse": 2.0}]}
        for r in _runs(setting, finals, batches):
            path = results / r["task"] / r["arm"] / f"seed{r['seed']}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(r))
    payload, text = confirm.analyse(results)
    assert not payload["missing"] and len(payload["answer"]) == 7
    check = subprocess.run([*tables, "--check"], capture_output=True, text=True)
    assert check.returncode == 1 and "docs/study.md" in check.stdout and "README.md" in check.stdout
    assert subprocess.run(tables, capture_output=True).returncode == 0
    page = (tmp_path / "docs" / "study.md").read_text()
    answer = page[page.index("<!-- study:confirm-answer -->") : page.index("<!-- /study:confirm-answer -->")]
    assert answer.count("\n- **") == 7 and "- **addition**: with the reuse limit, ExGRPO ended below GRPO" in answer
    assert "not in yet" not in answer.lower()
    for heading in ("## For a user:", "## Primary:", "## Secondary:", "## Concentration of replay"):
        section = text[text.index(heading) :]
        for row in section[section.index("\n| ") + 1 :].split("\n\n")[0].splitlines():
            assert row in page, (heading, row)
    reading = next(line for line in text.splitlines() if line.startswith("ExGRPO's `exgrpo/replay/reuse`, median"))
    assert reading in page and "ExGRPO was below GRPO in every setting" in reading
    assert subprocess.run([*tables, "--check"], capture_output=True).returncode == 0
    # the README's table for a user is now the registered one
    readme = (tmp_path / "README.md").read_text()
    user = text[text.index("## For a user:") :]
    assert user[user.index("\n| ") + 1 :].split("\n\n")[0] in readme


def test_reuse_reading_gives_a_threshold_only_where_the_settings_separate():
    """ExGRPO's reuse (median over seeds) 6.0 at addition, 3.5 at countdown-weak, 2.0 at the paper's shape and 4.5 at
    the hard setting. Lost at addition and hard: 4.5 > 3.5, a threshold between 3.50 and 4.50; lost at addition and
    countdown-weak: the lost settings span 3.5-6.0 and the others 2.0-4.5, which overlap: no threshold."""
    reuse = dict(zip(confirm.SETTINGS, (6.0, 3.5, 2.0, 4.5)))
    conc = [{"setting": s, "arm": "exgrpo", "reuse_mean": v} for s, v in reuse.items()]
    conc.append({"setting": "addition", "arm": "reuse_limit", "reuse_mean": 2.5})

    def rows(lost):
        return [{"setting": s, "arm": "exgrpo", "base": "grpo", "axis": a,
                 "verdict": "below" if (s, a) in lost else "not resolved"}
                for s in confirm.SETTINGS for a in ("final_rollouts", "final_updates")]  # fmt: skip

    text = confirm.reuse_reading(conc, rows({("addition", "final_updates"), ("countdown-hard", "final_rollouts")}))
    assert text.startswith("ExGRPO's `exgrpo/replay/reuse`, median over seeds of its mean over the run: addition 6.00 "
                           "(below GRPO); countdown-weak 3.50 (not below); countdown-paper-lr2.5e-5 2.00 (not below); "
                           "countdown-hard 4.50 (below GRPO); with `replay_cooldown: 9`: addition 2.50.")  # fmt: skip
    assert "below GRPO where its reuse averaged 4.50 or more and not where it averaged 3.50 or less" in text
    text = confirm.reuse_reading(conc, rows({("addition", "final_updates"), ("countdown-weak", "final_updates")}))
    assert "does not separate the settings where ExGRPO was below GRPO (reuse 3.50 to 6.00) from the others (2.00 " \
        "to 4.50): no threshold" in text  # fmt: skip
    text = confirm.reuse_reading(conc, rows(set()))
    assert text.endswith("no setting's ExGRPO - GRPO was resolved below 0 after Holm's correction, so no value of it "
                         "marks a resolved loss.")  # fmt: skip
    # ... and where an uncorrected interval lies below 0, it says which
    losing = rows(set())
    for c in losing:
        c.update(label="x", ci95=[-0.2, -0.1] if c["setting"] == "addition" else [-0.1, 0.1], mean=-0.15)
    assert text_end(confirm.reuse_reading(conc, losing)) == (
        "resolved loss; uncorrected, the 95% interval lies below 0 in addition at equal generated rollouts (-0.150 "
        "[-0.200, -0.100]); addition at equal updates (-0.150 [-0.200, -0.100])."
    )
    assert confirm.reuse_reading([], rows(set())) == "ExGRPO's `exgrpo/replay/reuse`: no ExGRPO run has logged it."


def text_end(text: str) -> str:
    return text[text.index("resolved loss") :]


def test_the_committed_analysis_is_what_the_committed_runs_give(tmp_path):
    """analysis.md and analysis.json of the registered study, written again by today's confirm.analyse from the
    committed runs (and the earlier study's, which the answer compares with), equal the committed files byte for
    byte: a change to the analysis code cannot move the published answer unseen."""
    committed = Path(__file__).resolve().parents[2] / confirm.RESULTS
    results = tmp_path / "confirm"
    results.mkdir()
    for entry in committed.iterdir():
        if not entry.name.startswith("analysis."):
            (results / entry.name).symlink_to(entry)
    (tmp_path / "study").symlink_to(committed.parent / "study")
    confirm.analyse(results)
    for name in ("analysis.md", "analysis.json"):
        assert (results / name).read_bytes() == (committed / name).read_bytes(), name
