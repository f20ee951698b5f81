"""The overhead benchmark's harness: turn order, and a tiny end-to-end run (benchmarks are never timed in tests)."""

import importlib.util
import json
import pathlib
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def overhead():
    spec = importlib.util.spec_from_file_location("overhead", ROOT / "benchmarks" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_turns_alternate_who_goes_first(overhead):
    # Two threads of 4 steps each: turns follow A B B A A B B A; once A is done B runs alone.
    turns = overhead._Turns(["a", "b"])
    order = []

    def work(name, steps):  # what `run_in_lockstep` and its callback do around each optimizer step
        turns.wait(name)
        for _ in range(steps):
            order.append(name)
            turns.pass_on(name)  # on_step_end
            turns.wait(name)
        turns.pass_on(name, finished=True)

    threads = [threading.Thread(target=work, args=("a", 4)), threading.Thread(target=work, args=("b", 6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert order == list("abbaabba") + list("bb")


def test_tiny_run_writes_its_figures(overhead, tmp_path):
    out = tmp_path / "figures.json"
    overhead.main(["--hidden-size", "32", "--layers", "1", "--heads", "2", "--questions-per-step", "4",
                   "--max-completion-length", "8", "--prefill-questions", "8", "--steps", "3", "--warmup-steps", "1",
                   "--json", str(out)])
    figures = json.loads(out.read_text())
    assert len(figures["step_times_s"]["grpo"]) == len(figures["step_times_s"]["exgrpo"]) == 2
    assert figures["ratio"] == pytest.approx(figures["exgrpo_median_s"] / figures["grpo_median_s"])
    assert set(figures["per_step_ms"]) >= {"entropy scoring", "plan (sample + broadcast)"}
