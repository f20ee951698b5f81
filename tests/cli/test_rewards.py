"""The math-verify reward (algorithm §9: binary check of the answer after </think>) and the reward registry."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exgrpo_trl.tasks import rewards
from exgrpo_trl.tasks.rewards import MathVerifier, answer_section, completion_text, get_reward_funcs, math_reward

DATA = Path(__file__).parents[1] / "data"

# (completion, reference answer, expected reward), each derived by hand.
EXACT_CASES = [
    # the answer after </think> is what counts
    ("<think>3/4 - 1/4</think> So $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    # equivalent forms: 0.5 == 1/2 (math-verify compares numerically)
    ("<think>x</think> \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    # a wrong answer
    ("<think>x</think> \\boxed{3}", "\\frac{1}{2}", 0.0),
    # no </think>: no answer section, reward 0 even though the boxed value is right
    ("The answer is \\boxed{720}", "720", 0.0),
    # the right answer inside the thought section only; after </think> a wrong one
    ("<think>maybe \\boxed{720}</think> final: \\boxed{721}", "720", 0.0),
    # several </think>: the text after the LAST one is the answer
    ("<think>a</think> \\boxed{1} <think>b</think> \\boxed{720}", "720", 1.0),
    # an empty answer section
    ("<think>all thought, no answer</think>", "720", 0.0),
    # multiple-choice letters
    ("<think>29 is prime</think> The answer is $\\boxed{C}$.", "C", 1.0),
    ("<think>29 is prime</think> The answer is $\\boxed{B}$.", "C", 0.0),
    # a reference answer that is an interval, given as bare LaTeX (wrapped in $...$ before parsing)
    ("<think>x > 2</think> $x \\in \\boxed{(2,\\infty)}$", "(2, \\infty)", 1.0),
]


@pytest.mark.parametrize("completion,answer,expected", EXACT_CASES)
def test_exact_values(completion, answer, expected):
    assert math_reward([completion], answer=[answer]) == [expected]


def test_conversational_and_malformed_completions():
    messages = [{"role": "assistant", "content": "<think>z</think> so \\boxed{\\dfrac12}"}]
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "<think>z</think> \\boxed{2}"}]}]
    user_turn = [{"role": "user", "content": "<think></think>\\boxed{2}"}]
    completions = [messages, parts, None, 12, [{"no_role": 1}], user_turn]
    answers = ["\\frac{1}{2}", "2", "2", "2", "2", "2"]
    # only assistant text counts; anything that is not a completion scores 0 and does not raise
    assert math_reward(completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert math_reward(["<think></think>\\boxed{2}"], answer=[None]) == [0.0]
    assert completion_text(parts) == "<think>z</think> \\boxed{2}"
    assert answer_section("a</think>b</think>c") == "c"
    assert answer_section("no tag") is None


def test_trl_keyword_arguments_and_metric():
    logged = {}
    completions = ["<think></think>\\boxed{4}", "\\boxed{4}", "<think></think>\\boxed{5}", "nothing"]
    out = math_reward(
        completions,
        answer=["4"] * 4,
        prompts=["p"] * 4,
        completion_ids=[[1]] * 4,
        trainer_state=None,
        log_extra=lambda column, values: None,
        log_metric=lambda name, value: logged.__setitem__(name, value),
        data_source=["x"] * 4,
    )
    assert out == [1.0, 0.0, 0.0, 0.0]
    # 2 of the 4 completions have no </think>
    assert logged == {"math_verify/no_think_end_fraction": 0.5}


def test_missing_answer_column_is_a_config_error():
    with pytest.raises(ValueError, match="'answer' column"):
        math_reward(["<think></think>1"], solution=["1"])


def test_require_think_end_off_scores_the_whole_text():
    verifier = MathVerifier(require_think_end=False)
    assert verifier.score("The answer is \\boxed{720}", "720") == 1.0
    assert verifier.score("<think>\\boxed{720}</think> \\boxed{1}", "720") == 0.0


def test_timeouts_must_be_positive():
    with pytest.raises(ValueError, match="must be > 0"):
        MathVerifier(parse_timeout_s=0)


def test_reference_trajectories_of_the_sample_data_verify():
    """The R1 solutions shipped in the OpenR1-Math-46k sample (column `target`) all check against their
    `reward_model.ground_truth`: ties the reward to the dataset's answer format."""
    rows = [json.loads(line) for line in (DATA / "openr1_math_46k_sample.jsonl").read_text().splitlines()]
    completions = [row["target"] for row in rows]  # conversational: [{"role": "assistant", "content": ...}]
    answers = [row["reward_model"]["ground_truth"] for row in rows]
    assert math_reward(completions, answer=answers) == [1.0] * len(rows)
    # and each one against the NEXT row's answer is wrong
    assert math_reward(completions, answer=answers[1:] + answers[:1]) == [0.0] * len(rows)


# ---------------------------------------------------------------------------------------------------------------
# Pathological inputs: each returns 0.0 within the verifier's budget, on the main thread and off it.
# ---------------------------------------------------------------------------------------------------------------
PARSE_S, VERIFY_S = 1.0, 1.0
# reference answer parse (cached after the first call) + completion parse + verification, plus scheduling slack
BUDGET_S = 2 * PARSE_S + VERIFY_S + 1.0

PATHOLOGICAL = {
    "long_number": "<think></think>\\boxed{" + "9" * 100_000 + "}",
    # parsing this takes ~10 s without a time limit
    "nested_sqrt": "<think></think>$" + "\\sqrt{" * 2000 + "2" + "}" * 2000 + "$",
    "nested_frac": "<think></think>\\boxed{" + "\\frac{" * 300 + "1" + "}{2}" * 300 + "}",
    "text_100kb": "<think></think>" + "lorem ipsum 3+4 = x, " * 5000,
    # sympy evaluates 9^(9^9) exactly: never finishes without a time limit
    "huge_power": "<think></think>\\boxed{9^{9^{9}}}",
    "unbalanced": "<think></think>\\boxed{" * 5000,
}


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(parse_timeout_s=PARSE_S, verify_timeout_s=VERIFY_S)
    yield v
    v.close()


# An alarm that lands in a finalizer the garbage collector runs mid-parse is printed and dropped by Python, by design
# (the timer fires again: test_a_time_limit_that_lands_in_a_finalizer_still_stops_the_phase); what is asserted here
# is the reward and the time, so pytest's warning about the dropped exception is not a failure of this test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_pathological_inputs_main_thread(verifier, name):
    assert len(PATHOLOGICAL["text_100kb"]) > 100_000
    start = time.monotonic()
    assert verifier.score(PATHOLOGICAL[name], "2") == 0.0
    elapsed = time.monotonic() - start
    assert elapsed < BUDGET_S, f"{name} took {elapsed:.1f}s"
    if name == "huge_power":  # it really needed the time limit: the comparison ran until stopped
        assert elapsed >= 0.9 * VERIFY_S


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_time_limit_that_lands_in_a_finalizer_still_stops_the_phase(monkeypatch):
    """A phase's first alarm can land in an object's __del__ that the garbage collector runs in the middle of the
    parse (in the full suite it landed in a datasets.Dataset's): Python prints an exception raised there and drops
    it, and a one-shot timer then let the parse run on unbounded (nested_sqrt took 7.1 s against a 1 s phase). The
    timer fires again every _RETRY_S until the phase is over, and a late alarm after it does nothing."""
    import math_verify

    real_parse = math_verify.parse
    dropped = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: dropped.append(u.exc_type))

    class Finalizer:
        def __del__(self):
            while True:  # a Python loop: the phase's first alarm is handled here, and ends the loop
                pass

    def parse(text, parsing_timeout=None):
        if text != "SLOW":
            return real_parse(text, parsing_timeout=parsing_timeout)  # the reference answer
        Finalizer()  # no reference kept: its __del__ runs at once, until the first alarm
        end = time.monotonic() + 10.0
        while time.monotonic() < end:  # the parse carries on: only a second alarm can stop it
            pass
        return []

    monkeypatch.setattr(math_verify, "parse", parse)
    previous = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    assert rewards._score_here("SLOW", "2", 0.5, 0.5) == 0.0
    elapsed = time.monotonic() - start
    assert dropped == [rewards._PhaseTimeout]  # the first alarm really was dropped in the finalizer
    # 0.5 s phase + one retry (0.05 s) + parsing "$2$"; a one-shot timer took the whole 10 s
    assert elapsed < 2.0, f"{elapsed:.1f}s"
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # nothing left armed
    assert signal.getsignal(signal.SIGALRM) is previous
    assert rewards._raise_phase_timeout(signal.SIGALRM, None) is None  # an alarm after the phase: no raise


def test_pathological_inputs_off_the_main_thread(verifier):
    """Off the main thread math-verify's signal timeouts raise; the helper process keeps it bounded and killable."""
    # start the helper process first (its start-up is not charged to a completion)
    box: list = []
    warm = threading.Thread(target=lambda: box.append(verifier.score("<think></think>\\boxed{2}", "2")))
    warm.start()
    warm.join()
    assert box == [1.0]

    def run(name):
        start = time.monotonic()
        score = verifier.score(PATHOLOGICAL[name], "2")
        return name, score, time.monotonic() - start

    with ThreadPoolExecutor(max_workers=1) as pool:
        results = list(pool.map(run, sorted(PATHOLOGICAL)))
        # still scores correctly afterwards (a killed helper is restarted)
        after = pool.submit(verifier.score, "<think></think>\\boxed{\\frac{1}{2}}", "0.5").result()
    for name, score, elapsed in results:
        assert score == 0.0, name
        assert elapsed < BUDGET_S, f"{name} took {elapsed:.1f}s off the main thread"
    assert after == 1.0


def test_math_reward_from_worker_threads_never_raises():
    completions = ["<think></think>\\boxed{6}", "<think></think>\\boxed{7}"] * 3
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(lambda c: math_reward([c], answer=["6"])[0], completions))
    assert outs == [1.0, 0.0] * 3


def test_an_outer_interval_timer_survives():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        assert math_reward(["<think></think>\\boxed{2}"], answer=["2"]) == [1.0]
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90.0 < remaining <= 100.0
        assert not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------
def test_registry_by_name_and_by_path():
    from exgrpo_trl.tasks.toy import addition_reward

    funcs = get_reward_funcs(["math_verify", "toy_addition", "exgrpo_trl.tasks.rewards:math_reward"])
    assert funcs == [math_reward, addition_reward, math_reward]
    assert get_reward_funcs("toy_addition") == [addition_reward]
    assert sorted(rewards.REWARD_FUNCS) == ["math_verify", "toy_addition"]


@pytest.mark.parametrize("name", ["no_such_reward", "exgrpo_trl.tasks.rewards:no_such_function", "no_such_module:f"])
def test_registry_rejects_unknown_names(name):
    with pytest.raises(ValueError, match="math_verify|cannot import"):
        get_reward_funcs([name])


def test_registry_rejects_empty():
    with pytest.raises(ValueError, match="no reward function"):
        get_reward_funcs([])
