"""The replay bookkeeping of one generation batch (algorithm §2-5, §7), free of the training loop.

No trl, transformers or accelerate imports (`scripts/check_imports.py` enforces it): everything here works on plain
lists, dicts, numpy arrays and CPU tensors, and is tested directly in `tests/algorithm/test_replay.py`. `run.py` calls
these at each step of a generation batch and adds what needs the other ranks (the broadcast of the draw, the gathers);
the trainer passes in what needs the model (entropy scoring).

One generation batch, in order:
1.-2. `draw.draw`: which questions to replay (`replay_count` of them) and which stored trajectory of each, every rule
   in order; `ReplayPlan` is what it fixes.
3. `assign_rows`: each replayed group's K rows get its question; its first row is reserved for the stored trajectory.
4. `batch_outcome`: success per row and count k per group, from the rewards TRL gathered across ranks.
5. `collect`: what to commit to the buffer (groups and the rows whose trajectories are stored) once the behaviour
   log-probs are known; `commit` applies the gathered outcome of every rank to the buffer.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .buffer import ExperienceBuffer, Trajectory, row_key

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ 1. drawing
def replay_count(buffer_questions: int, replay_ratio: float, num_groups: int) -> int:
    """n_exp = min(#questions in the buffer, floor(rho * #groups)) (algorithm §5). The epsilon keeps 0.5 * 6 at 3."""
    return min(buffer_questions, math.floor(replay_ratio * num_groups + 1e-9))


@dataclass
class ReplayQuestion:
    """A question drawn for replay, with the dataset row it is re-scored with and its candidate trajectories."""

    key: str
    row: dict[str, Any]
    candidates: list[Trajectory]  # in stored order (oldest first)
    bucket: int = 0  # its success count k when drawn
    repeat: bool = False  # also replayed in the draw before this one


def replay_never_fires(cfg) -> str | None:
    """A warning when the generation batch is too small for the replay ratio to replay a single group, else None.
    `cfg`: an `ExGRPOConfig` (its batch shape and settings).

    With TRL's default batch shape (8 rows, K = 8: one question per generation batch) n_exp = floor(rho * 1) = 0 at
    every step: nothing is ever replayed, and ExGRPOTrainer trains GRPO with retirement."""
    if not cfg.replays:
        return None
    groups = cfg.generation_batch_size // cfg.num_generations  # questions per generation batch, all ranks together
    if replay_count(groups, cfg.replay_ratio, groups) > 0:
        return None
    needed = math.ceil(1.0 / cfg.replay_ratio - 1e-9)
    return (
        f"ExGRPO: replay_ratio={cfg.replay_ratio:g} will never replay anything: a generation batch of "
        f"{cfg.generation_batch_size} rows holds {groups} question(s) of num_generations={cfg.num_generations} "
        f"rollouts, and floor({cfg.replay_ratio:g} x {groups}) = 0 of them come from the buffer. Give a generation "
        f"batch at least {needed} questions (generation_batch_size >= {needed * cfg.num_generations}, or more "
        "steps_per_generation, gradient_accumulation_steps or per_device_train_batch_size), or raise replay_ratio; "
        "replay_ratio=0 trains GRPO."
    )


# ------------------------------------------------------------------------------------------------ 2. the plan
@dataclass
class ReplayPlan:
    """What one generation batch replays, identical on every rank. The last `len(questions)` groups are replayed;
    per replayed question, in group order, the lists below (properties) read off its question and its trajectory."""

    questions: list[ReplayQuestion]  # the drawn questions (key, dataset row, bucket when drawn, repeat flag)
    trajectories: list[Trajectory]  # the selected stored trajectory of each
    num_groups: int  # groups in the whole generation batch
    clock: int  # the generation batch it is for (the run's clock)
    selected_entropies: list[float] = field(default_factory=list)  # of the scored (>= 2 candidates) questions
    with_trajectories: bool = True  # False: the questions are revisited with K fresh rollouts, no stored row
    uses: list[int] = field(default_factory=list)  # each selected trajectory's replays, this one included

    @property
    def group_indices(self) -> list[int]:
        """The global groups whose K rows are given to replayed questions: the last ones."""
        return list(range(self.num_groups - len(self.questions), self.num_groups))

    @property
    def keys(self) -> list[str]:
        return [q.key for q in self.questions]

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [q.row for q in self.questions]

    @property
    def buckets(self) -> list[int]:
        """Each replayed question's success count k when drawn."""
        return [q.bucket for q in self.questions]

    @property
    def repeats(self) -> list[bool]:
        """Whether each replayed question was also replayed in the generation batch before."""
        return [q.repeat for q in self.questions]

    @property
    def collected_at(self) -> list[int]:
        """The generation batch each selected trajectory was collected in."""
        return [int(t.collected_at) for t in self.trajectories]

    @functools.cached_property
    def completion_ids(self) -> list[list[int]]:
        return [t.completion_ids.tolist() for t in self.trajectories]

    @functools.cached_property
    def behaviour_logps(self) -> list[torch.Tensor]:
        """(L,) float32 each."""
        return [torch.tensor(t.logps, dtype=torch.float32) for t in self.trajectories]

    @property
    def repeat_share(self) -> float:
        """The share of this batch's replayed questions that were also replayed in the generation batch before."""
        repeats = self.repeats
        return sum(repeats) / len(repeats) if repeats else 0.0

    def mask(self, j: int) -> list[int]:
        """Trajectory j's model mask (all ones when every token is the model's)."""
        mask = self.trajectories[j].mask
        return [1] * len(self.completion_ids[j]) if mask is None else mask.tolist()

    def record(self, j: int) -> dict[str, Any]:
        """Trajectory j's record ({} when it has none)."""
        return self.trajectories[j].record or {}

    @classmethod
    def build(
        cls,
        drawn: Sequence[ReplayQuestion],
        chosen: Sequence[int],
        num_groups: int,
        clock: int,
        selected_entropies=(),
        with_trajectories: bool = True,
    ) -> ReplayPlan:
        """The plan from the drawn questions and the index of each one's chosen candidate."""
        picked = [question.candidates[c] for question, c in zip(drawn, chosen)]
        uses = [t.uses + 1 for t in picked] if with_trajectories else []
        return cls(list(drawn), picked, num_groups, clock, list(selected_entropies), with_trajectories, uses)


# ------------------------------------------------------------------------------------------------ 3. rows
@dataclass
class RowAssignment:
    """This rank's rows after the plan is applied."""

    inputs: list[dict[str, Any]]  # the dataset rows, replayed groups' rows replaced by their question's
    replay_rows: list[int]  # per local row: the plan index whose stored trajectory it carries, -1 for a fresh row
    splice: dict[int, list[int]]  # local row -> stored (or offline) completion ids to put in place of a generated one
    offline: dict[int, Any] = field(default_factory=dict)  # local row -> its `offline.OfflineRow` (also in `splice`)

    def is_replayed(self, local: int) -> bool:
        return self.replay_rows[local] >= 0

    def with_offline(self, chosen: dict[int, tuple[Any, list[int]]]) -> RowAssignment:
        """These rows with each row of `chosen` (local row -> (OfflineRow, token ids)) given its offline solution,
        spliced in place of a generated completion as a stored trajectory is."""
        if not chosen:
            return self
        splice = {**self.splice, **{local: ids for local, (_, ids) in chosen.items()}}
        return RowAssignment(self.inputs, self.replay_rows, splice, {local: row for local, (row, _) in chosen.items()})

    def without_offline(self, rows: set[int]) -> RowAssignment:
        """These rows with the offline rows in `rows` (their solution scored unsolved) fresh rows again."""
        if not rows:
            return self
        offline = {local: row for local, row in self.offline.items() if local not in rows}
        return RowAssignment(self.inputs, self.replay_rows, self.splice, offline)


def assign_rows(inputs: Sequence[dict], plan: ReplayPlan | None, *, process_index: int, k: int) -> RowAssignment:
    """Give the K rows of each replayed group to its question and reserve the group's first row for its stored
    trajectory (none for a plan without trajectories: all K rows are generated). Rank r holds global rows
    r * len(inputs) ... (r + 1) * len(inputs) - 1 (TRL's contiguous split)."""
    inputs = list(inputs)
    replay_rows = [-1] * len(inputs)
    splice: dict[int, list[int]] = {}
    if plan is None:
        return RowAssignment(inputs, replay_rows, splice)
    offset = process_index * len(inputs)
    for j, (group, row) in enumerate(zip(plan.group_indices, plan.rows)):
        for global_row in range(group * k, (group + 1) * k):
            local = global_row - offset
            if 0 <= local < len(inputs):
                inputs[local] = dict(row)
                if global_row == group * k and plan.with_trajectories:
                    replay_rows[local] = j
                    splice[local] = plan.completion_ids[j]
    return RowAssignment(inputs, replay_rows, splice)


def merge_spliced(
    num_rows: int, generated: Sequence[int], completion_ids: list, logprobs: list | None, splice: dict[int, list[int]]
) -> tuple[list, list | None]:
    """All `num_rows` rows of one turn: the `generated` rows' sampled completions (in that order) and each spliced
    row's stored ids. A spliced row's sampling log-probs are unknown (None: NaN in TRL, and NaN an importance ratio of
    exactly 1, so vLLM's sampling correction leaves the row alone; its own weight is applied in the loss)."""
    ids: list = [None] * num_rows
    out_logprobs = None if logprobs is None else [None] * num_rows
    for j, i in enumerate(generated):
        ids[i] = completion_ids[j]
        if out_logprobs is not None:
            out_logprobs[i] = logprobs[j]
    for row, stored in splice.items():
        ids[row] = list(stored)
        if out_logprobs is not None:
            out_logprobs[row] = [None] * len(stored)
    return ids, out_logprobs


def splice_rollout(output: dict[str, Any], rows: RowAssignment, plan: ReplayPlan) -> dict[str, Any]:
    """A rollout function's output with each reserved row replaced by its stored trajectory: token ids, model mask
    (`env_mask`, created for every row if the function returned none), the per-row fields the function returned for
    it when it was stored, and unknown sampling log-probs (as in `merge_spliced`)."""
    n = len(output["completion_ids"])
    output = {key: list(value) if isinstance(value, list) else value for key, value in output.items()}
    completion_ids, logprobs = output["completion_ids"], output["logprobs"]
    if output.get("env_mask") is None and any(t.mask is not None for t in plan.trajectories):
        output["env_mask"] = [[1] * len(ids) for ids in completion_ids]
    for row in rows.splice:
        j = rows.replay_rows[row]
        completion_ids[row] = list(plan.completion_ids[j])
        if logprobs is not None:
            logprobs[row] = [None] * len(completion_ids[row])
        if output.get("env_mask") is not None:
            output["env_mask"][row] = plan.mask(j)
        for key, value in plan.record(j).get("fields", {}).items():
            if isinstance(output.get(key), list) and len(output[key]) == n:
                output[key][row] = copy.deepcopy(value)
    return output


# ------------------------------------------------------------------------------------------------ 4. outcome
@dataclass
class BatchOutcome:
    """Success of every row of the whole generation batch (global row order)."""

    solved: torch.Tensor  # (N,) bool
    successes: list[int]  # k per global group
    pass_at_1: float  # fraction of all rows solved


def batch_outcome(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, threshold: float, k: int
) -> BatchOutcome:
    """A row is solved when its weighted total reward reaches `threshold` (algorithm §2); NaN rewards (a function that
    returned None) count as 0, and a row with every reward NaN is never solved. `rewards_per_func`: (N, F)."""
    total = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)  # (N,)
    solved = (total >= threshold) & ~torch.isnan(rewards_per_func).all(dim=1)  # (N,)
    return BatchOutcome(solved, solved.view(-1, k).sum(dim=1).tolist(), solved.float().mean().item())


def threshold_mismatch(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, solved: torch.Tensor, threshold: float, k: int
) -> str | None:
    """A warning when `success_reward_threshold` cannot tell rollouts apart in this batch, else None.

    Rewards that vary within a group while every rollout counts as solved (a reward such as 1 + 4 * correct with the
    default threshold 1.0), or while none does (correct answers scoring below the threshold), mean the threshold does
    not sit between a wrong and a right answer: success counts are all K/K (or all 0), Pass@1 is wrong, and the
    buffer stays empty. Totals as `batch_outcome` computes them (NaN rewards count as 0)."""
    total = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1).view(-1, k)
    if not bool((total.amax(dim=1) > total.amin(dim=1)).any()):
        return None  # no group tells rollouts apart: nothing to judge the threshold by
    low, high = total.min().item(), total.max().item()
    if bool(solved.all()):
        what = "every rollout of this batch counts as solved"
        effect = "batch Pass@1 reads 1.0, every question is retired and the experience buffer stays empty"
    elif not bool(solved.any()):
        what = "no rollout of this batch counts as solved"
        effect = "nothing is stored in the experience buffer and the delayed start cannot be reached"
    else:
        return None
    return (
        f"ExGRPO: {what} (weighted total reward >= success_reward_threshold={threshold:g}), yet rewards vary within "
        f"groups (from {low:g} to {high:g}): {effect}. Set success_reward_threshold to the weighted total reward of a "
        f"correct answer (here perhaps {high:g})."
    )


# ------------------------------------------------------------------------------------------------ 5. collection
@dataclass
class GroupOutcome:
    """One group's result, reported by the rank that holds the group's first row."""

    group: int  # global group index
    key: str
    k: int  # successes out of K
    row: dict[str, Any] | None  # the dataset row to store with the question (None: nothing to store)


@dataclass
class StoredRow:
    """A row whose completion will be stored once its behaviour log-probs are known (`completion_ids` and `logps`
    are set then, with its model `mask`), and what `commit` receives of it from every rank."""

    global_row: int
    key: str
    record: dict[str, Any] | None = None  # what the reward functions saw of a multi-turn row (`Trajectory.record`)
    completion_ids: list[int] | None = None
    logps: list[float] | None = None  # the behaviour policy's, per token
    mask: list[int] | None = None  # 1 for the model's tokens; None: all of them
    advantage: float | None = None  # the advantage TRL gave the row (`Trajectory.advantage`)


@dataclass
class PendingCollection:
    """One generation batch's outcome on this rank, committed to the buffer after the first loss pass over it."""

    groups: list[GroupOutcome]
    rows: dict[int, StoredRow]  # local row -> where it goes
    micro_batches_left: int  # loss passes until every row of the batch has been seen once
    collected_at: int  # the generation batch the trajectories are collected in

    def take_recorded(self) -> list[StoredRow]:
        """The rows whose behaviour log-probs are known, removed from `rows` (each is committed once)."""
        done = [local for local, row in self.rows.items() if row.logps is not None]
        return [self.rows.pop(local) for local in done]


def collect(
    rows: RowAssignment,
    outcome: BatchOutcome,
    completion_ids: Sequence[Sequence[int]],
    *,
    process_index: int,
    k: int,
    collecting: bool,
    stop_ids: set[int] | frozenset[int],
    micro_batches_left: int,
    clock: int,
    masks: Sequence[Sequence[int] | None] | None = None,
) -> PendingCollection:
    """What this rank will commit (algorithm §2, §4): every group with k > 0 (K/K retires it; before the delayed start
    only retirement counts), and, while collecting, the solved generated rows of groups with 0 < k < K whose completion
    the model ended: its last token is a stop token and the model's (a truncated completion, or a multi-turn one
    whose last tokens a tool or an environment wrote, is never stored). `clock`: the generation batch (the stamp of the
    trajectories); `masks`: per local row, 1 for the model's tokens (None: all of them)."""
    num_local = len(rows.inputs)
    offset = process_index * num_local
    groups, stored = [], {}
    for local in range(num_local):
        global_row = offset + local
        group = global_row // k
        successes = outcome.successes[group]
        key = row_key(rows.inputs[local])
        if global_row % k == 0 and successes > 0:
            keep_row = collecting and successes < k
            groups.append(GroupOutcome(group, key, successes, rows.inputs[local] if keep_row else None))
        ids = completion_ids[local]
        mask = masks[local] if masks is not None else None
        if (
            collecting
            and 0 < successes < k
            and bool(outcome.solved[global_row])
            and not rows.is_replayed(local)
            and local not in rows.offline  # an offline solution is not the model's own success (algorithm §11)
            and ids
            and ids[-1] in stop_ids
            and (mask is None or bool(mask[len(ids) - 1]))
        ):
            stored[local] = StoredRow(global_row, key)
    return PendingCollection(groups, stored, micro_batches_left, clock)


def commit(
    buffer: ExperienceBuffer,
    gathered: Sequence[tuple[list[GroupOutcome], list[StoredRow]]],
    *,
    collected_at: int,
    is_main_process: bool,
    k: int,
) -> None:
    """Apply every rank's (groups, trajectories) to the buffer, in global row order so that every world size builds
    the same buffer, the trajectories stamped with `collected_at` (their generation batch). Only the main process
    holds trajectories; the others keep the retired set (for the sampler)."""
    groups = sorted((g for rank_groups, _ in gathered for g in rank_groups), key=lambda g: g.group)
    by_key: dict[str, list[Trajectory]] = {}
    if is_main_process:
        rows = sorted((row for _, rank_rows in gathered for row in rank_rows), key=lambda row: row.global_row)
        for row in rows:
            trajectory = Trajectory(row.completion_ids, row.logps, collected_at, row.mask, row.record, row.advantage)
            by_key.setdefault(row.key, []).append(trajectory)
    for g in groups:
        if is_main_process:
            buffer.update_group(g.key, g.k, g.row, by_key.pop(g.key, ()))
        elif g.k == k:
            buffer.retire(g.key)
