"""scripts/same_behaviour.py: what it compares, that it tells a difference, and one real comparison of two trees."""

from __future__ import annotations

import importlib.util
import subprocess

import torch

from tests.helpers import ROOT, make_trainer


def load_script():
    spec = importlib.util.spec_from_file_location("same_behaviour", ROOT / "scripts" / "same_behaviour.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_run_differing_in_weights_buffer_or_logs_is_told(tmp_path, tokenizer):
    """Fingerprints of real runs: the same seed twice is the same; another model seed differs in all three parts,
    and the first differing log value is named; a mode that fails on one side only is a difference."""
    script = load_script()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {}
        for name, seed in (("a", 0), ("b", 0), ("c", 1)):
            trainer = make_trainer(
                tmp_path / name, tokenizer, model_seed=seed, replay_start_pass_rate=0.0, max_steps=2
            )
            trainer.train()
            runs[name] = script.fingerprint(trainer)
    finally:
        torch.set_num_threads(threads)
    key = ("mode", "replay")
    assert script.compare({key: runs["a"]}, {key: runs["b"]}) == [("mode", "replay", "same")]
    ((_, _, verdict),) = script.compare({key: runs["a"]}, {key: runs["c"]})
    assert verdict.startswith("DIFFERS: weights, buffer, logs (log row 0 ")
    assert runs["a"]["replayed"] == 1  # the second of 2 batches replayed: the runs compared were replay runs
    failed = {"error": "AttributeError: 'ReplayPlan' object has no attribute 'masks'"}
    assert script.compare({key: failed}, {key: runs["a"]}) == [
        ("mode", "replay", "fails at BASE: AttributeError: 'ReplayPlan' object has no attribute 'masks'")
    ]
    assert script.compare({}, {key: runs["a"]}) == [("mode", "replay", "only at HEAD")]
    # wall times are not training: a log that differs only in them is the same
    assert script.training_logs(type("T", (), {"state": type("S", (), {"log_history": [{"step_time": 1.0}]})})) == [{}]


def test_head_against_the_working_tree(tmp_path, capsys):
    """The whole command on one mode of each kind: the committed code against this checkout's, each trained in its
    own process from its own tree (a detached worktree for the commit, removed afterwards)."""
    script = load_script()
    code = script.main(["HEAD", "--only", "dr_grpo", "rollout_func with env_mask", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    changed = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "exgrpo_trl"]).returncode
    lines = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert len(lines) == 4 and out.count("replay fired in 2 of the replay-on runs") == 1
    if not changed:  # the package as committed: every run the same
        assert code == 0 and all(line[0] == "same" for line in lines), out
    worktrees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in worktrees and "tree-HEAD" not in worktrees
