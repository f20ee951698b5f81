"""Grading one completion: math answers (last box, math-verify) and letter choices; see the package docstring."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..tasks.rewards import MathVerifier, answer_section, completion_text
from .registry import EvalQuestion, normalize_reference

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# Grading
# ----------------------------------------------------------------------------------------------------------------
class Grade(NamedTuple):
    """One completion's score (0.0 / 1.0) and the answer read from it (None: nothing found)."""

    score: float
    extracted: str | None


_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    r"""The content of the last complete ``\boxed{...}`` / ``\fbox{...}`` (nested braces matched), or None.

    A box left open (a truncated completion) is skipped, and the last complete one before it is returned.
    """
    if not isinstance(text, str):
        return None
    for match in reversed(list(_BOX_START.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def final_answer_text(completion: Any, require_think_end: bool = False) -> str | None:
    """The text that is graded: after the last ``</think>``; without one, the whole completion, or None when
    `require_think_end` (the training reward's rule)."""
    text = completion_text(completion)
    section = answer_section(text)
    if section is None:
        return None if require_think_end else text
    return section


_EVAL_VERIFIER: MathVerifier | None = None


def _verifier() -> MathVerifier:
    global _EVAL_VERIFIER
    if _EVAL_VERIFIER is None:
        # The think/no-think decision is taken in final_answer_text; the verifier then scores the text it is given.
        _EVAL_VERIFIER = MathVerifier(require_think_end=False)
    return _EVAL_VERIFIER


def grade_math(
    completion: Any,
    answers: Any,
    *,
    require_think_end: bool = False,
    verifier: MathVerifier | None = None,
) -> Grade:
    r"""1.0 when the final answer equals one of `answers` (math-verify), else 0.0; never raises.

    The final answer is the last complete ``\boxed{}`` of `final_answer_text`, else that whole text (math-verify's
    own extraction). `extracted` is the last box's content (None when there is none).
    """
    references = normalize_reference(answers)
    section = final_answer_text(completion, require_think_end)
    if section is None or not section.strip() or not references:
        return Grade(0.0, None)
    boxed = last_boxed(section)
    target = "\\boxed{" + boxed + "}" if boxed is not None else section
    verifier = verifier or _verifier()
    for reference in references:
        if verifier.score(target, reference) == 1.0:
            return Grade(1.0, boxed)
    return Grade(0.0, boxed)


_LATEX_WRAPPER = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}"
)
_LETTER_ONLY = re.compile(r"[(\[]?\s*([A-Z])\s*[)\]]?\s*[.:]?")
_LETTER_LEAD = re.compile(r"[(\[]?([A-Z])[)\].:]\s+\S")
_ANSWER_STATEMENT = re.compile(
    r"(?i:\b(?:final\s+)?answer\b|\b(?:correct|best|right)\s+(?:option|choice|answer)\b)"
    r"(?:\s*(?i:is|would\s+be|should\s+be|must\s+be|will\s+be|=|:))?"
    r"\s*(?i:option|choice)?"
    r"[\s*_$]*[(\[]?\s*([A-Z])\s*[)\]]?"
    r"(?![A-Za-z0-9])"
)
_PAREN_LETTER = re.compile(r"\(([A-Z])\)")


def _clean_fragment(text: str) -> str:
    previous = None
    while previous != text:
        previous, text = text, _LATEX_WRAPPER.sub(r"\1", text)
    text = text.replace("$", "").replace("**", "").replace("__", "")
    text = text.strip().strip("*_`").strip()
    return re.sub(r"[.!。]+$", "", text).strip()


def _normalize_option(text: str) -> str:
    return re.sub(r"\s+", " ", _clean_fragment(str(text))).strip(" .,;:").lower()


def _letter_of_fragment(
    fragment: str, letters: str, options: Sequence[str] | None = None, *, match_options: bool = True
) -> str | None:
    text = _clean_fragment(fragment)
    match = _LETTER_ONLY.fullmatch(text)
    if match:
        return match.group(1) if match.group(1) in letters else None
    match = _LETTER_LEAD.match(text)
    if match and match.group(1) in letters:
        return match.group(1)
    if match_options and options:
        key = _normalize_option(text)
        hits = [
            letters[i] for i, option in enumerate(options[: len(letters)]) if key and _normalize_option(option) == key
        ]
        if len(hits) == 1:
            return hits[0]
    return None


def extract_choice(text: str | None, letters: str = "ABCD", options: Sequence[str] | None = None) -> str | None:
    """The option letter a text answers with, by the rules of the module docstring (boxed > answer statement >
    parenthesised letter > last line), or None (unparsable). `letters` are the valid letters, in option order;
    `options` their texts (for ``\\boxed{option text}``)."""
    if not isinstance(text, str) or not text.strip():
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        letter = _letter_of_fragment(boxed, letters, options)
        if letter is not None:
            return letter
    for match in reversed(list(_ANSWER_STATEMENT.finditer(text))):
        if match.group(1) in letters:
            return match.group(1)
    for match in reversed(list(_PAREN_LETTER.finditer(text))):
        if match.group(1) in letters:
            return match.group(1)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if lines:
        return _letter_of_fragment(lines[-1], letters, match_options=False)
    return None


def grade_choice(
    completion: Any,
    answer: str,
    letters: str = "ABCD",
    options: Sequence[str] | None = None,
    *,
    require_think_end: bool = False,
) -> Grade:
    """1.0 when the letter read from the graded text (`extract_choice`) is `answer`, else 0.0."""
    letter = extract_choice(final_answer_text(completion, require_think_end), letters, options)
    return Grade(1.0 if letter is not None and letter == str(answer).strip() else 0.0, letter)


def avg_at_k(scores: Sequence[Sequence[float]]) -> float:
    """Mean over questions of the mean over each question's samples (a fraction; NaN for no questions)."""
    per_question = [sum(s) / len(s) for s in scores if len(s)]
    return sum(per_question) / len(per_question) if per_question else math.nan


def grade(question: EvalQuestion, completion: Any, *, require_think_end: bool = False) -> Grade:
    """Grade one completion of `question` by its kind."""
    if question.kind == "choice":
        return grade_choice(
            completion,
            question.answers[0],
            question.letters or "",
            question.options,
            require_think_end=require_think_end,
        )
    return grade_math(completion, question.answers, require_think_end=require_think_end)
