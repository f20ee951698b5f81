"""Reward functions, chosen by name in a recipe (``reward_funcs: [math_verify]``).

- ``math_verify``: the paper's verifier (algorithm §9): 1.0 when the final answer written after ``</think>`` is
  mathematically equal to the reference answer according to math-verify, else 0.0. No format bonus. A completion
  without ``</think>`` has no answer section and scores 0 (``MathVerifier(require_think_end=False)`` scores its whole
  text instead). The reference answer is parsed as ``$answer$``, as LUFFY's evaluation script does.
- ``toy_addition``: exact match for the toy addition task of the tiny CPU kit
  (`exgrpo_trl.tasks.toy.addition_reward`).

Any other ``module:function`` path is imported as is, so a recipe can use a reward function of its own: the module is
looked up where Python looks, then in the current folder (``reward_funcs: [myrewards:fn]`` finds ``./myrewards.py``).

Timeouts. math-verify's own ``parsing_timeout`` / ``timeout_seconds`` use ``signal.alarm``, which exists only on the
main thread (elsewhere math-verify raises ``ValueError``) and counts whole seconds per comparison. We therefore call
math-verify with its timeouts off and bound each phase ourselves:

- on the main thread (where TRL calls reward functions) with a ``SIGALRM`` interval timer around each phase; the
  timer raises a ``BaseException`` so that math-verify's ``except Exception`` clauses cannot swallow it and carry on,
  and raises again every 50 ms until the phase is over (a raise that lands in a finalizer run by the garbage collector
  mid-parse is dropped by Python);
- on any other thread, in a helper process that runs the same code on its own main thread; the caller waits at most
  the total budget and kills the helper if it overruns (a thread cannot be interrupted, a process can).

Either way a completion costs at most ``parse_timeout_s`` (reference answer, cached per answer) +
``parse_timeout_s`` (completion) + ``verify_timeout_s``, and every failure (timeout, parse error, malformed input)
scores 0.0 instead of raising. (A signal is handled between bytecodes, so on the main thread a single C call that never
returns could outlast its phase; the inputs tested, 9^(9^9) included, all stop on time. The helper process has no
such gap: it is killed.)
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..utils.requirements import require

__all__ = [
    "THINK_END",
    "REWARD_FUNCS",
    "MathVerifier",
    "completion_text",
    "answer_section",
    "math_reward",
    "get_reward_func",
    "get_reward_funcs",
]

THINK_END = "</think>"
DEFAULT_PARSE_TIMEOUT_S = 3.0
DEFAULT_VERIFY_TIMEOUT_S = 3.0
# Budget for starting the helper process (imports sympy and math-verify); not charged to any completion.
WORKER_START_TIMEOUT_S = 120.0
# Extra wall time granted to the helper process on top of the phase budgets (pipe round trip, scheduling).
WORKER_SLACK_S = 1.0

logger = logging.getLogger(__name__)


class _PhaseTimeout(BaseException):
    """Raised by our SIGALRM handler. A BaseException so that library code catching Exception cannot absorb it."""


class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeouts are off and that the caller must bound the time: we do."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_QuietTimeoutWarning())


# ----------------------------------------------------------------------------------------------------------------
# Text handling
# ----------------------------------------------------------------------------------------------------------------
def completion_text(completion: Any) -> str:
    """The text of one TRL completion: a plain string, or a conversational list of messages.

    For messages, the contents of the assistant messages are joined (TRL gives ``[{"role": "assistant",
    "content": ...}]``); a content may also be a list of ``{"type": "text", "text": ...}`` parts. Anything else
    gives "" (scored 0), never an exception.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if not isinstance(completion, (list, tuple)):
        return ""
    parts: list[str] = []
    for message in completion:
        if not isinstance(message, dict) or message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, (list, tuple)):
            parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "".join(parts)


def answer_section(text: str) -> str | None:
    """The text after the LAST ``</think>``, or None when there is none (no answer section: reward 0)."""
    head, sep, tail = text.rpartition(THINK_END)
    return tail if sep else None


# ----------------------------------------------------------------------------------------------------------------
# Time limits
# ----------------------------------------------------------------------------------------------------------------
def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


# An alarm's exception can land in an object's __del__ that the garbage collector runs in the middle of a parse;
# Python prints an exception raised there and drops it. So the timer fires again every _RETRY_S until the phase is
# over (the timer's interval), and the handler raises only while a phase runs (_armed; main thread only).
_RETRY_S = 0.05
_armed = False


def _raise_phase_timeout(signum, frame):
    if _armed:  # else an alarm after its phase ended: nothing to stop
        raise _PhaseTimeout()


def _run_limited(seconds: float, phase: Callable[[], Any]) -> Any:
    """`phase()`, with `_PhaseTimeout` raised in the main thread after `seconds` of wall time (and every _RETRY_S
    after that until the phase is over). Main thread only.

    Restores the previous SIGALRM handler and re-arms a timer that was already running (minus the time spent
    here), so that an outer user of ITIMER_REAL is not silently disarmed.
    """
    global _armed
    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, _raise_phase_timeout)
    _armed = True
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3), _RETRY_S)
    try:
        return phase()
    finally:
        # First, before any call (Python runs a signal handler at a call or a jump back, not at a store): from here
        # on an alarm does nothing, so no _PhaseTimeout can be raised past this function.
        _armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - start), 1e-3), old_interval)


# ----------------------------------------------------------------------------------------------------------------
# Scoring, in-process (main thread, or the helper process's main thread)
# ----------------------------------------------------------------------------------------------------------------
_GOLD_CACHE: dict[str, list] = {}
_GOLD_CACHE_MAX = 100_000


def _parse_gold(answer: str, parse_timeout_s: float) -> list:
    """Parse a reference answer once. Wrapped in ``$...$`` first, as the reference code does, so that a bare
    LaTeX answer (``\\frac{1}{2}``) is read as math; falls back to the raw string (already delimited answers)."""
    cached = _GOLD_CACHE.get(answer)
    if cached is not None:
        return cached
    from math_verify import parse

    gold: list = []
    try:
        gold = _run_limited(
            parse_timeout_s, lambda: parse(f"${answer}$", parsing_timeout=None) or parse(answer, parsing_timeout=None)
        )
    except _PhaseTimeout:
        gold = []
    if gold and len(_GOLD_CACHE) < _GOLD_CACHE_MAX:
        _GOLD_CACHE[answer] = gold
    return gold


def _score_here(solution: str, answer: str, parse_timeout_s: float, verify_timeout_s: float) -> float:
    """1.0 / 0.0 for an answer section against a reference answer. Must run on the main thread."""
    from math_verify import parse, verify

    try:
        gold = _parse_gold(answer, parse_timeout_s)
        if not gold:
            return 0.0
        pred = _run_limited(parse_timeout_s, lambda: parse(solution, parsing_timeout=None))
        if not pred:
            return 0.0
        return 1.0 if _run_limited(verify_timeout_s, lambda: verify(gold, pred, timeout_seconds=None)) else 0.0
    except _PhaseTimeout:
        return 0.0
    except Exception:  # noqa: BLE001 - a reward never raises on a completion; malformed input scores 0
        logger.debug("math_verify reward: scoring failed", exc_info=True)
        return 0.0


def _worker_main() -> None:
    """The helper process: JSON lines in (solution, answer, timeouts), one JSON line out (score)."""
    import math_verify  # noqa: F401 - pay the import before announcing readiness

    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            score = _score_here(req["solution"], req["answer"], req["parse_timeout_s"], req["verify_timeout_s"])
        except Exception:  # noqa: BLE001
            score = 0.0
        out.write(json.dumps({"score": score}).encode() + b"\n")
        out.flush()


class _Worker:
    """A helper process scoring one completion at a time, killed and restarted when it overruns its budget."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-c", "from exgrpo_trl.tasks.rewards import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        if self._read_line(proc, WORKER_START_TIMEOUT_S) is None:
            self._kill(proc)
            raise RuntimeError("the math_verify helper process did not start")
        return proc

    @staticmethod
    def _read_line(proc: subprocess.Popen, timeout_s: float) -> dict | None:
        ready, _, _ = select.select([proc.stdout], [], [], max(timeout_s, 0.0))
        if not ready:
            return None
        line = proc.stdout.readline()
        return json.loads(line) if line else None

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()

    def score(self, solution: str, answer: str, parse_timeout_s: float, verify_timeout_s: float) -> float:
        budget = 2 * parse_timeout_s + verify_timeout_s + WORKER_SLACK_S
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = self._start()
                request = {
                    "solution": solution,
                    "answer": answer,
                    "parse_timeout_s": parse_timeout_s,
                    "verify_timeout_s": verify_timeout_s,
                }
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
                reply = self._read_line(self._proc, budget)
            except (OSError, ValueError, RuntimeError):
                reply = None
            if reply is None:  # overran its budget, died, or never started: start afresh next time
                if self._proc is not None:
                    self._kill(self._proc)
                self._proc = None
                return 0.0
            return float(reply.get("score", 0.0))

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._kill(self._proc)
                self._proc = None


# ----------------------------------------------------------------------------------------------------------------
# The reward function
# ----------------------------------------------------------------------------------------------------------------
class MathVerifier:
    """Binary math-verify reward on the answer after ``</think>``, with bounded time per completion.

    Args:
        parse_timeout_s: time limit for parsing one expression (the completion; the reference answer once).
        verify_timeout_s: time limit for the comparison of one completion with its reference answer.
        require_think_end: when False, a completion without ``</think>`` is scored on its whole text instead of 0.
    """

    def __init__(
        self,
        parse_timeout_s: float = DEFAULT_PARSE_TIMEOUT_S,
        verify_timeout_s: float = DEFAULT_VERIFY_TIMEOUT_S,
        require_think_end: bool = True,
    ):
        if parse_timeout_s <= 0 or verify_timeout_s <= 0:
            raise ValueError("parse_timeout_s and verify_timeout_s must be > 0: they are what keeps a reward bounded.")
        # Scoring swallows every failure as 0.0, so without math-verify every answer would silently score 0.
        require("math_verify", "the math_verify reward")
        self.parse_timeout_s = float(parse_timeout_s)
        self.verify_timeout_s = float(verify_timeout_s)
        self.require_think_end = require_think_end
        self._worker = _Worker()

    def score(self, completion: Any, answer: Any) -> float:
        """Score one completion (string or messages) against one reference answer. Never raises."""
        try:
            if answer is None:
                return 0.0
            text = completion_text(completion)
            solution = answer_section(text)
            if solution is None:
                if self.require_think_end:
                    return 0.0
                solution = text
            if not solution.strip():
                return 0.0
            answer = str(answer)
            if _on_main_thread():
                return _score_here(solution, answer, self.parse_timeout_s, self.verify_timeout_s)
            return self._worker.score(solution, answer, self.parse_timeout_s, self.verify_timeout_s)
        except Exception:  # noqa: BLE001
            logger.debug("math_verify reward: unexpected failure", exc_info=True)
            return 0.0

    def __call__(self, completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs) -> list[float]:
        if answer is None:
            raise ValueError(
                "the math_verify reward needs the reference answers: the training dataset must have an 'answer' "
                f"column (TRL passes dataset columns as keyword arguments; got {sorted(kwargs)})."
            )
        if len(answer) != len(completions):
            raise ValueError(f"got {len(completions)} completions but {len(answer)} answers.")
        rewards = [self.score(c, a) for c, a in zip(completions, answer)]
        log_metric = kwargs.get("log_metric")
        if callable(log_metric) and completions:
            missing = sum(answer_section(completion_text(c)) is None for c in completions)
            log_metric("math_verify/no_think_end_fraction", missing / len(completions))
        return rewards

    def close(self) -> None:
        """Stop the helper process, if one was started (it also dies with this process)."""
        self._worker.close()


_DEFAULT_VERIFIER: MathVerifier | None = None


def math_reward(completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the answer after ``</think>`` equals the reference ``answer``, else 0.0.

    TRL passes every dataset column as a keyword argument (plus ``prompts``, ``completion_ids``,
    ``trainer_state``, ``log_extra``, ``log_metric``); only ``answer`` is read. Default time limits
    (`DEFAULT_PARSE_TIMEOUT_S`, `DEFAULT_VERIFY_TIMEOUT_S`); build a `MathVerifier` for others.
    """
    global _DEFAULT_VERIFIER
    if _DEFAULT_VERIFIER is None:
        _DEFAULT_VERIFIER = MathVerifier()
    return _DEFAULT_VERIFIER(completions, answer=answer, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------------------
# name -> "module:function", imported on first use (the toy reward pulls in torch; math_verify pulls in sympy).
REWARD_FUNCS: dict[str, str] = {
    "math_verify": "exgrpo_trl.tasks.rewards:math_reward",
    "toy_addition": "exgrpo_trl.tasks.toy:addition_reward",
}


def _unknown_reward(name: str) -> str | None:
    module_name, sep, attr = REWARD_FUNCS.get(name, name).partition(":")
    if not sep or not module_name or not attr:
        return f"unknown reward function {name!r}: use one of {sorted(REWARD_FUNCS)} or a 'module:function' path."
    return None


def _search_the_current_folder() -> None:
    if os.getcwd() not in sys.path and "" not in sys.path:  # the current folder, after everything installed
        sys.path.append(os.getcwd())


def reward_func_problem(name: str, find_module: bool = True) -> str | None:
    """What is wrong with reward function `name` that can be told without running any of its code (`exgrpo train`
    asks before torch is imported): an unknown registry name, or (`find_module`) a ``module:function`` whose module
    cannot be found from here. None when nothing is."""
    problem = _unknown_reward(name)
    if problem is not None or not find_module:
        return problem
    module_name = REWARD_FUNCS.get(name, name).partition(":")[0]
    _search_the_current_folder()
    try:
        found = importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):  # a parent package that is missing or fails to import
        found = False
    if not found:
        return (
            f"reward function {name!r}: no module {module_name!r} in the folder you launch from or on the Python "
            "path (PYTHONPATH)"
        )
    return None


def get_reward_func(name: str) -> Callable:
    """A reward function by registry name (`REWARD_FUNCS`) or by ``module:function`` path."""
    problem = _unknown_reward(name)
    if problem is not None:
        raise ValueError(problem)
    target = REWARD_FUNCS.get(name, name)
    module_name, _, attr = target.partition(":")
    _search_the_current_folder()
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import reward function {name!r} ({target}): {exc}") from exc
    if not callable(func):
        raise ValueError(f"reward function {name!r} ({target}) is not callable.")
    return func


def get_reward_funcs(names: Sequence[str]) -> list[Callable]:
    if isinstance(names, str):
        names = [names]
    if not names:
        raise ValueError(
            f"no reward function given: set reward_funcs, e.g. [math_verify]; known: {sorted(REWARD_FUNCS)}"
        )
    return [get_reward_func(name) for name in names]
