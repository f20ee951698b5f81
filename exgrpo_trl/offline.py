"""Offline guidance (algorithm §11): reference solutions from a dataset column join fresh GRPO groups as an off-policy
row, LUFFY's mixed groups (arXiv 2504.14945) inside ExGRPO.

A question whose dataset row holds a reference completion (`ExGRPOConfig.offline_solutions_column`) gets it as the
first row of its fresh group, beside K - 1 generated rollouts, with behaviour log-prob 0 on every token (probability
1: the policy that wrote it is unknown), so each of its tokens weighs f(pi_theta) = pi_theta / (pi_theta + gamma) in
the replayed-token term. The decisions, each tested in `tests/algorithm/test_offline.py`:

- which groups: every fresh group of a question with a usable solution (`all_groups`, LUFFY's rule), or only those of
  questions the model has not yet solved itself, no on-policy success stored and not retired (`unsolved`); a
  replayed group never gets one (it already holds its stored row);
- which solution: the first of the question's solutions that is usable: it fits `max_completion_length` once
  tokenized, and the reward functions have not scored it unsolved;
- verification: the reward functions score an offline row like any row; one they do not score as solved carries no
  gradient in that batch (its advantage is set to 0 and it leaves the replayed-token term) and is never used again;
- the buffer: an offline row is never stored and never a candidate for lowest-entropy selection (the buffer holds
  the model's own successes), but it counts in its group's successes k, as a replayed row does, so a question whose
  K - 1 fresh rollouts all succeed beside its solution is retired.

No trl, transformers or accelerate imports: the tokenizer is passed in, and the state is plain JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .buffer import row_key

OFFLINE_GUIDANCE = ("all_groups", "unsolved")


def offline_texts(value: Any, column: str = "offline solutions") -> list[str]:
    """The reference completions a dataset cell holds, as text: a string, an assistant message (TRL's conversational
    completion: a list of messages, the last one's content), or a list of either. None or empty: none."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, dict):
        return offline_texts([value], column)
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(m, dict) for m in value):  # one conversational completion
            content = value[-1].get("content")
            if not isinstance(content, str):
                raise ValueError(f"column {column}: a message without text content: {value[-1]!r}")
            return [content] if content else []
        texts = []
        for item in value:
            texts.extend(offline_texts(item, column))
        return texts
    raise ValueError(
        f"column {column}: expected a string, a list of messages or a list of either, got {type(value).__name__}"
    )


@dataclass
class OfflineGuide:
    """Which fresh groups get an offline row, and with which solution; identical on every rank.

    `tokenize(text) -> ids` gives a solution's completion token ids as the model's completion of its prompt would be
    (its text, then EOS). `rejected` holds the (question key, solution index) pairs the reward functions scored
    unsolved; `self_solved` the questions with an on-policy success stored. Both are training state (checkpoints).
    """

    column: str
    rule: str
    max_length: int
    tokenize: Callable[[str], list[int]]
    rejected: set[tuple[str, int]] = field(default_factory=set)
    self_solved: set[str] = field(default_factory=set)
    too_long: set[tuple[str, int]] = field(default_factory=set)

    def solution(self, key: str, row: dict[str, Any], retired: set[str] | frozenset = frozenset()):
        """(index, token ids) of the solution question `key` (its dataset `row`) gets in a fresh group, or None."""
        if self.rule == "unsolved" and (key in self.self_solved or key in retired):
            return None
        for index, text in enumerate(offline_texts(row.get(self.column), self.column)):
            if (key, index) in self.rejected:
                continue
            # tokenized at each use, not kept: a cache would grow to every solution of the dataset (46k at the
            # paper's scale, thousands of tokens each), and a generation batch tokenizes at most one per group
            ids = list(self.tokenize(text))
            if len(ids) > self.max_length:
                self.too_long.add((key, index))
                continue
            return index, ids
        return None

    active = True  # `NoOfflineGuide` is the guide of a run without offline guidance
    last_rows = 0  # offline rows (every rank's) in the last training generation batch: never generated

    def add_rows(self, rows, plan, *, process_index: int, k: int, retired: set[str] | frozenset = frozenset()) -> None:
        """Give each fresh group's first row held here its question's solution (`offline_rows`), spliced in place of
        a generated completion as a replayed group's stored trajectory is. `rows`: this rank's `RowAssignment`."""
        chosen = offline_rows(
            rows.inputs,
            self,
            [row_key(x) for x in rows.inputs],
            replayed_groups=plan.group_indices if plan is not None else (),
            process_index=process_index,
            k=k,
            retired=retired,
        )
        for local, (row, ids) in chosen.items():
            rows.splice[local] = ids
            rows.offline[local] = row

    def judge(
        self, rows, outcome, advantages: torch.Tensor, gather_objects: Callable[[list], list]
    ) -> dict[str, float]:
        """After the reward functions have scored the batch: every rank learns every offline row's verdict (one
        collective, `gather_objects`), a solution scored unsolved is rejected for good and its row gets advantage 0
        (no gradient; it leaves the replayed-token term), and the batch's Pass@1 (the delayed start's) counts generated
        rows only. `rows`: this rank's `RowAssignment`; `outcome`: the batch's `BatchOutcome`. Returns the batch's
        figures."""
        solved = outcome.solved.tolist()  # one copy to the host, not one per row
        local_rows = [(row.key, row.index, row.global_row) for row in rows.offline.values()]
        everything = [row for rank_rows in gather_objects([local_rows]) for row in rank_rows]
        verdicts = offline_verdicts(everything, solved)
        self.rejected.update(verdicts.unsolved)
        self.last_rows = len(everything)
        for local, row in list(rows.offline.items()):
            if not solved[row.global_row]:
                advantages[local] = 0.0
                del rows.offline[local]
        outcome.pass_at_1 = verdicts.pass_at_1
        return {
            "offline/groups": len(everything) / max(1, len(outcome.successes)),
            "offline/unsolved": len(verdicts.unsolved),
        }

    def gauges(self) -> dict[str, float]:
        """Counts logged as their value, never a window mean."""
        return {"offline/rejected": float(len(self.rejected))}

    def note_self_solved(self, keys) -> None:
        """Questions with an on-policy success now stored (the `unsolved` rule)."""
        self.self_solved.update(keys)

    def state_dict(self) -> dict[str, Any]:
        return {
            "rejected": sorted([key, index] for key, index in self.rejected),
            "self_solved": sorted(self.self_solved),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rejected = {(key, int(index)) for key, index in state.get("rejected", [])}
        self.self_solved = set(state.get("self_solved", []))


class NoOfflineGuide:
    """The guide of a run without offline guidance: no row gets a solution, nothing is judged, logged or saved."""

    active = False
    last_rows = 0
    too_long: frozenset = frozenset()

    def add_rows(self, rows, plan, **_) -> None:
        pass

    def judge(self, rows, outcome, advantages, gather_objects) -> dict[str, float]:
        return {}

    def gauges(self) -> dict[str, float]:
        return {}

    def note_self_solved(self, keys) -> None:
        pass

    def state_dict(self) -> None:
        return None  # nothing in the checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@dataclass
class OfflineRow:
    """A fresh group's first row given an offline solution (this rank's local row)."""

    key: str
    index: int  # which of the question's solutions
    global_row: int


def offline_rows(
    inputs: Sequence[dict[str, Any]],
    guide: OfflineGuide,
    keys: Sequence[str],
    *,
    replayed_groups: Sequence[int],
    process_index: int,
    k: int,
    retired: set[str] | frozenset = frozenset(),
) -> dict[int, tuple[OfflineRow, list[int]]]:
    """The local rows that get an offline solution: the first row of each fresh group held here (group g's first row
    is global row g * K; the groups in `replayed_groups` are replay's), when `guide` gives one. `keys`: each local
    row's question key. Returns local row -> (OfflineRow, token ids)."""
    offset = process_index * len(inputs)
    replayed = set(replayed_groups)
    chosen = {}
    for local, row in enumerate(inputs):
        global_row = offset + local
        if global_row % k or global_row // k in replayed:
            continue
        found = guide.solution(keys[local], row, retired)
        if found is not None:
            index, ids = found
            chosen[local] = (OfflineRow(keys[local], index, global_row), ids)
    return chosen


@dataclass
class OfflineVerdicts:
    """What the reward functions' scores say of one generation batch's offline rows (`offline_verdicts`)."""

    unsolved: list[tuple[str, int]]  # (question, solution index) scored unsolved: rejected from now on
    rows: set[int]  # the global rows that held an offline solution
    pass_at_1: float  # the batch's Pass@1 over its generated rows only (what the delayed start reads)


def offline_verdicts(rows: Sequence[tuple[str, int, int]], solved: Sequence[bool]) -> OfflineVerdicts:
    """`rows`: every rank's offline rows as (question key, solution index, global row); `solved`: each global row's
    success. The Pass@1 is a float32 mean as `replay.batch_outcome` computes it, 0 when every row was offline."""
    unsolved = [(key, index) for key, index, g in rows if not solved[g]]
    offline = {g for _, _, g in rows}
    generated = [s for g, s in enumerate(solved) if g not in offline]
    pass_at_1 = torch.tensor(generated, dtype=torch.float32).mean().item() if generated else 0.0
    return OfflineVerdicts(unsolved, offline, pass_at_1)
