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
from .settings import ExGRPOSettings


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

    def rows_for(
        self, inputs, replayed_groups, *, process_index: int, k: int, retired: set[str] | frozenset = frozenset()
    ) -> dict[int, tuple[OfflineRow, list[int]]]:
        """The rows of this rank's `inputs` (its share of the generation batch) that get an offline solution: each
        fresh group's first row held here, when its question has one (`offline_rows`): local row -> (OfflineRow,
        token ids), spliced in place of a generated completion as a replayed group's stored trajectory is."""
        keys = [row_key(x) for x in inputs]
        return offline_rows(
            inputs, self, keys, replayed_groups=replayed_groups, process_index=process_index, k=k, retired=retired
        )

    def judge(self, offline: dict[int, OfflineRow], outcome, gather_objects: Callable[[list], list]) -> Judgement:
        """After the reward functions have scored the batch: every rank learns every offline row's verdict (one
        collective, `gather_objects`) and a solution scored unsolved is rejected for good (the guide's own state).
        Returns what follows for the batch (`Judgement`): this rank's rows scored unsolved (advantage 0: no gradient;
        they leave the replayed-token term), the batch's Pass@1 over its generated rows (the delayed start's), and
        its metrics. `offline`: this rank's offline rows (local row -> OfflineRow); `outcome`: the `BatchOutcome`."""
        solved = outcome.solved.tolist()  # one copy to the host, not one per row
        local_rows = [(row.key, row.index, row.global_row) for row in offline.values()]
        everything = [row for rank_rows in gather_objects([local_rows]) for row in rank_rows]
        verdicts = offline_verdicts(everything, solved)
        self.rejected.update(verdicts.unsolved)
        self.last_rows = len(everything)
        metrics = {
            "offline/groups": len(everything) / max(1, len(outcome.successes)),
            "offline/unsolved": len(verdicts.unsolved),
        }
        unsolved = {local for local, row in offline.items() if not solved[row.global_row]}
        return Judgement(unsolved, verdicts.pass_at_1, metrics)

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

    def rows_for(self, inputs, replayed_groups, **_) -> dict:
        return {}

    def judge(self, offline, outcome, gather_objects) -> Judgement:
        return Judgement(set(), outcome.pass_at_1, {})

    def gauges(self) -> dict[str, float]:
        return {}

    def note_self_solved(self, keys) -> None:
        pass

    def state_dict(self) -> None:
        return None  # nothing in the checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@dataclass
class Judgement:
    """What the reward functions' scores of one batch's offline rows mean for the batch (`OfflineGuide.judge`)."""

    unsolved: set[int]  # this rank's local rows whose solution was scored unsolved: advantage 0, out of the term
    pass_at_1: float  # the batch's Pass@1 over its generated rows (every row's without offline guidance)
    metrics: dict[str, float]


def make_offline_guide(
    settings: ExGRPOSettings, max_length: int, tokenize: Callable[[str], list[int]]
) -> OfflineGuide | NoOfflineGuide:
    """The run's guide: reference solutions from the settings' column (`OfflineGuide`), or none when it is unset."""
    if settings.offline_solutions_column is None:
        return NoOfflineGuide()
    return OfflineGuide(settings.offline_solutions_column, settings.offline_guidance, max_length, tokenize)


def offline_columns(settings: ExGRPOSettings) -> list[str]:
    """The dataset columns offline guidance reads from the training rows ([] when it is off)."""
    return [] if settings.offline_solutions_column is None else [settings.offline_solutions_column]


def check_offline_arguments(params: dict[str, Any]) -> None:
    """Offline guidance needs its column in the train_dataset, and single-turn rollouts: an offline solution has no
    tool calls, environment steps or rollout-function fields to carry. `params`: GRPOTrainer's arguments."""
    columns_needed = offline_columns(params["args"])
    if not columns_needed:
        return
    (column,) = columns_needed
    for name in ("tools", "environment_factory", "rollout_func"):
        if params.get(name):
            raise ValueError(
                f"offline_solutions_column cannot be used with {name}: an offline solution is single-turn text, "
                "with no tool calls, environment steps or rollout fields to replay"
            )
    dataset = params.get("train_dataset")
    columns = getattr(dataset, "column_names", None)
    if dataset is None or (columns is not None and column not in columns):
        have = ", ".join(columns or []) or "no train_dataset"
        raise ValueError(
            f"offline_solutions_column {column!r} is not a column of the train_dataset ({have}); `exgrpo train` keeps "
            "it by itself, a dataset of your own must hold it"
        )


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
