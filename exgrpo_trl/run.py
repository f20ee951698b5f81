"""`ExGRPORun`: the steps of one generation batch under GRPOTrainer's hooks, on ExGRPO's state (`ExGRPOState`).

No trl, transformers or accelerate imports (`scripts/check_imports.py` enforces it): what needs the model or the other
processes is passed in as callables (`experience.Ranks`, the entropy scorer), so a run works on plain lists and
tensors in one process, as `tests/algorithm/test_run.py` drives it. `ExGRPOTrainer` builds one and calls it from
TRL's hooks; a feature that is off is a null object (`offline.NoOfflineGuide`), not a branch.

One training generation batch, in the order the trainer's hooks call the run (algorithm page, "How it works inside
TRL"):
1. `generation_batch` opens the batch (a context manager: the run owns it, TRL's inner hooks read it as
   `open_batch`, it is closed when the block ends): it commits what is still pending (`flush`), draws and scores the
   replay plan, and gives the rows to replayed questions and to offline solutions.
2. `scored`: what the reward functions saw, and the rewards with a stored trajectory's environment rewards put back.
3. `finish`: success per row, the offline verdicts, the collection to commit, the per-row keys the loss reads, the
   delayed start, the batch's metrics; the clock moves on. It returns what to add to TRL's batch.
4. Each loss pass: `record_behaviour` (the first pass over each row; the last one commits it: `flush`) and
   `replay_term`, the shaped replayed-token loss.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from .buffer import row_images
from .draw import draw
from .loss import ReplayTokenStats, aggregate_token_loss, shaped_replay_token_loss
from .replay import (
    PendingCollection,
    ReplayPlan,
    RowAssignment,
    assign_rows,
    batch_outcome,
    collect,
    commit,
    threshold_mismatch,
)
from .settings import clip_removal_problem
from .training_state import METRIC_PREFIX, ExGRPOState


class BatchKey:
    """The per-row keys ExGRPO adds to the batch dict TRL's `_generate_and_score_completions` returns; TRL's shuffle
    and split of the batch carry them along with every row to `_compute_loss`."""

    ROW = "exgrpo_row"  # (B,) the row's index in this rank's generation batch
    COLLECT = "exgrpo_collect"  # (B,) its completion is stored once its behaviour log-probs are known
    REPLAY_MASK = "exgrpo_replay_mask"  # (B,) the row carries a stored trajectory
    BEHAVIOUR_LOGPS = "exgrpo_behaviour_logps"  # (B, T) the stored trajectory's behaviour log-probs, 0 elsewhere
    UNCLIPPED = "exgrpo_unclipped"  # (B,) generated after replay started: no PPO clip on its fresh tokens
    OFFLINE = "exgrpo_offline"  # (B,) the row carries an offline solution (in REPLAY_MASK too; behaviour log-prob 0)


@dataclass(frozen=True)
class Rollouts:
    """What the run needs to know of the trainer's rollouts and loss, fixed for a run."""

    tokenize: Callable[[str], list[int]]  # text -> token ids as the model's completion of its prompt (text, EOS)
    max_completion_length: int
    stop_ids: frozenset[int]  # the ids a completion the model ended ends with (EOS ids and pad)
    loss_type: str  # TRL's (the replayed-token term is aggregated as TRL aggregates its own)
    reward_names: tuple[str, ...] = ()  # each reward column's name
    env_reward_columns: tuple[int, ...] = ()  # the reward columns an environment owns (`get_reward`)
    keeps_messages: bool = False  # a tool loop runs: a stored trajectory keeps its message list
    steps_per_generation: int = 1  # TRL's: micro-batches per generation batch (the loss normaliser of some types)


@dataclass
class Scored:
    """What TRL handed the reward functions for one generation batch (`ExGRPORun.scored`), this rank's rows."""

    completion_ids: list[list[int]]  # whole (multi-turn) completions
    prompts: list[Any]  # the prompts, as an environment's reset() may have completed them
    completions: list[Any]  # decoded completions (with a tool loop: its message lists)
    fields: list[dict[str, Any]]  # per row, the columns a rollout function added to the dataset row
    rewards: torch.Tensor  # (N_global, F): every rank's rewards, gathered


@dataclass
class GenerationBatch:
    """One training generation batch, owned by the run that opened it (`ExGRPORun.generation_batch`)."""

    clock: int  # its number: the generation batches made before it
    plan: ReplayPlan | None  # what is replayed (the same on every rank)
    rows: RowAssignment  # this rank's rows: which carry a replayed question, a stored trajectory, an offline solution
    turns: int = 0  # generation calls so far (`next_turn`)
    scored: Scored | None = None  # what the reward functions saw, once they have run

    def next_turn(self) -> bool:
        """Count one generation call; True for the first, the only one that holds every row (the tool loop calls
        again for the rows that called a tool)."""
        self.turns += 1
        return self.turns == 1


def _plain(value):
    """JSON fallback for what reward functions see: numpy and torch values as plain numbers and lists."""
    if isinstance(value, (np.generic, np.ndarray, torch.Tensor)):
        return value.tolist()
    raise TypeError(f"a value of type {type(value).__name__}")


class ExGRPORun:
    """The cycle of one generation batch on `state` (module docstring).

    Args:
        state: the run's `ExGRPOState` (read, and moved on: clock, buffer, delayed start).
        rollouts: the trainer's rollouts and loss (`Rollouts`).
        metrics: where the batch metrics go, a mapping of name -> list (TRL's training metrics: averaged over the
            logging window, then cleared).
    """

    def __init__(self, state: ExGRPOState, rollouts: Rollouts, metrics: dict[str, list[float]] | None = None):
        settings = state.settings
        problem = clip_removal_problem(settings, rollouts.loss_type)
        if problem is not None:
            raise ValueError(problem)
        self.state, self.rollouts = state, rollouts
        self.metrics = collections.defaultdict(list) if metrics is None else metrics
        self.pending: PendingCollection | None = None  # the last batch's outcome, until committed to the buffer
        self.last_plan: ReplayPlan | None = None  # the last training generation batch's (None: nothing replayed)
        # Set to a list to receive, per loss pass, the importance weights w of this rank's replayed tokens (1-D,
        # detached, on the CPU): the distribution behind the logged means. None: nothing is kept.
        self.replay_token_weights: list[torch.Tensor] | None = None
        self._open: GenerationBatch | None = None
        self._warned: set[str] = set()  # the messages said once per run

    @property
    def open_batch(self) -> GenerationBatch | None:
        """The generation batch being generated and scored (None outside `generation_batch`)."""
        return self._open

    # ------------------------------------------------------------------------------------------ 1. the batch
    @contextlib.contextmanager
    def generation_batch(
        self, inputs: Sequence[dict], score: Callable[..., torch.Tensor]
    ) -> Iterator[GenerationBatch]:
        """Step 1: open the generation batch of this rank's `inputs` (its share of the batch) with the plan applied,
        for the block. `score(rows, prompts, completion_ids, masks)`: the mean entropy of each candidate under the
        current policy, the same on every rank (a collective: every rank calls it, with the same candidates)."""
        self.flush()  # normally already done after the first loss pass; a no-op then
        state = self.state
        num_groups = len(inputs) * state.ranks.num_processes // state.num_generations
        plan = self.last_plan = self._plan(num_groups, score)
        with self.opened(GenerationBatch(state.clock, plan, self._rows(inputs, plan))) as batch:
            yield batch

    @contextlib.contextmanager
    def opened(self, batch: GenerationBatch) -> Iterator[GenerationBatch]:
        """Within the block `batch` is the open batch (`open_batch`); closed when the block ends, however it ends."""
        self._open = batch
        try:
            yield batch
        finally:
            self._open = None

    def _rows(self, inputs: Sequence[dict], plan: ReplayPlan | None) -> RowAssignment:
        """This rank's rows with the plan applied (`replay.assign_rows`) and each fresh group's first row given its
        question's offline solution, if any (`OfflineGuide.rows_for`)."""
        state, k = self.state, self.state.num_generations
        rows = assign_rows(inputs, plan, process_index=state.ranks.process_index, k=k)
        replayed = plan.group_indices if plan is not None else ()
        offline = state.offline.rows_for(
            rows.inputs, replayed, process_index=state.ranks.process_index, k=k, retired=state.buffer.retired
        )
        return rows.with_offline(offline)

    def _plan(self, num_groups: int, score: Callable[..., torch.Tensor]) -> ReplayPlan | None:
        """Draw the replayed questions on the main process, broadcast them, and select one trajectory per question
        by its mean entropy under the current policy (algorithm §5-6)."""
        state, settings = self.state, self.state.settings
        if not (state.replay_active and settings.replays):
            return None
        # On the main process the buffer draws; the stored arrays themselves (int32 ids, float16 log-probs) are pickled
        # as raw bytes for the broadcast, where Python lists cost ~5x the time and twice the bytes (see
        # benchmarks/buffer_memory.py); every rank scores the candidates (sharded) and selects.
        return draw(
            state.buffer, settings, num_groups, state.clock, is_main_process=state.ranks.is_main_process,
            share=state.ranks.broadcast, score=score,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ 2. scored
    def scored(
        self, batch: GenerationBatch, inputs, prompts, completions, completion_ids, rewards: torch.Tensor
    ) -> torch.Tensor:
        """Step 2, once the reward functions have run: keep what they saw (the rows TRL handed them, with the fields
        a rollout function added; `rewards` gathered over ranks, (N_global, F)), and return the rewards with a stored
        trajectory's environment-owned rewards (`get_reward`) put back on its replayed row: its tool calls are not run
        again, so its environment is only reset and would score it afresh."""
        plan, columns = batch.plan, self.rollouts.env_reward_columns
        if plan is not None and plan.with_trajectories and columns:
            rewards = rewards.clone()
            k = self.state.num_generations
            for j, group in enumerate(plan.group_indices):
                stored = plan.record(j).get("rewards", {})
                for column in columns:
                    name = self.rollouts.reward_names[column]
                    if name in stored:
                        rewards[group * k, column] = math.nan if stored[name] is None else stored[name]
        fields = [{k: v for k, v in x.items() if k not in row} for x, row in zip(inputs, batch.rows.inputs)]
        batch.scored = Scored([list(ids) for ids in completion_ids], list(prompts), list(completions), fields, rewards)
        return rewards

    # ------------------------------------------------------------------------------------------ 3. finish
    def finish(
        self, batch: GenerationBatch, output: dict[str, Any], *, reward_weights: torch.Tensor, micro_batches_left: int
    ) -> dict[str, Any]:
        """Step 3, on TRL's scored batch `output` (this rank's rows): outcomes, the offline verdicts, the collection
        (committed once the behaviour log-probs are known), the delayed start, the metrics; the clock moves on.
        Returns the entries to set in `output`: the per-row keys for the loss (`BatchKey`) and, when an offline
        solution was scored unsolved, the advantages with its row's set to 0. `micro_batches_left`: loss passes until
        every row has been seen once."""
        state, settings, k = self.state, self.state.settings, self.state.num_generations
        seen = batch.scored
        outcome = batch_outcome(seen.rewards, reward_weights, settings.success_reward_threshold, k)
        self._check_threshold(seen.rewards, reward_weights, outcome)
        judgement = state.offline.judge(batch.rows.offline, outcome, state.ranks.gather_objects)
        state.add_metrics(self.metrics, judgement.metrics)
        state.set_values(state.offline.gauges())
        if state.offline.too_long:
            self._warn_once(
                "too long",
                f"ExGRPO: {len(state.offline.too_long)} offline solution(s) are longer than max_completion_length "
                f"({self.rollouts.max_completion_length} tokens) once tokenized and are not used",
            )
        updates: dict[str, Any] = {}
        if judgement.unsolved:  # no gradient for a solution scored unsolved: it leaves the replayed-token term too
            updates["advantages"] = output["advantages"].clone()
            updates["advantages"][sorted(judgement.unsolved)] = 0.0
        rows = batch.rows = batch.rows.without_offline(judgement.unsolved)
        outcome = replace(outcome, pass_at_1=judgement.pass_at_1)  # generated rows only
        collecting = state.replay_active  # the state this batch was generated under
        tool_mask = output.get("tool_mask")  # (B, T): 0 where a tool or an environment inserted the token
        masks = None
        if tool_mask is not None:
            masks = [tool_mask[i, : len(ids)].tolist() for i, ids in enumerate(seen.completion_ids)]
        pending = self.pending = collect(
            rows, outcome, seen.completion_ids, process_index=state.ranks.process_index, k=k, collecting=collecting,
            stop_ids=self.rollouts.stop_ids, micro_batches_left=micro_batches_left, clock=batch.clock, masks=masks,
        )  # fmt: skip
        if pending.rows:  # TRL's advantages of this rank's rows, one copy to the host: what a stored success carried
            advantages = output["advantages"].tolist()
            for local, stored in pending.rows.items():
                stored.advantage = advantages[local]
        for local in list(pending.rows):
            try:
                pending.rows[local].record = self._row_record(batch, local)
            except (TypeError, ValueError) as e:  # what the reward functions saw of it cannot be saved: not stored
                del pending.rows[local]
                self._warn_once(
                    "record",
                    f"ExGRPO: a successful rollout is not stored: what its reward functions saw is not JSON ({e})",
                )
        updates.update(self._row_keys(output, batch, pending))
        # generated after replay started (never when nothing replays): no clip on fresh tokens
        if settings.remove_clip_after_replay_start and collecting and settings.replays:
            updates[BatchKey.UNCLIPPED] = torch.ones(len(rows.inputs), dtype=torch.bool, device=outcome.solved.device)
        # The delayed start (algorithm §7): judged on a purely on-policy batch, effective from the next one; stays on.
        threshold = settings.replay_start_pass_rate or 0.0
        if not state.replay_active and outcome.pass_at_1 > threshold:
            state.replay_active = True
            state.messages.info(f"ExGRPO: batch Pass@1 {outcome.pass_at_1:.3f} > {threshold}: replay starts.")
        state.clock += 1
        self._batch_metrics(batch.plan, outcome, collecting)
        return updates

    def _row_record(self, batch: GenerationBatch, local: int) -> dict[str, Any] | None:
        """What the reward functions were given for this rank's row `local` beyond its token ids, for a replay to
        give them again without running a tool or an environment (`Trajectory.record`): the message list of a tool
        loop, environment-owned rewards, a rollout function's per-row fields, the prompt as an environment's reset()
        completed it. None when there is nothing of the kind (single-turn training); TypeError or ValueError when it
        is not JSON."""
        seen, rollouts = batch.scored, self.rollouts
        record: dict[str, Any] = {}
        if rollouts.keeps_messages:
            record["completion"] = seen.completions[local]
        if rollouts.env_reward_columns:
            row = self.state.ranks.process_index * len(batch.rows.inputs) + local
            values = [seen.rewards[row, c].item() for c in rollouts.env_reward_columns]
            names = [rollouts.reward_names[c] for c in rollouts.env_reward_columns]
            record["rewards"] = {name: None if math.isnan(v) else v for name, v in zip(names, values)}
        if seen.fields[local]:
            record["fields"] = seen.fields[local]
        row = batch.rows.inputs[local]
        # TRL's prompt of a row with images holds them (not JSON); an environment cannot complete it (rejected at init)
        if not row_images(row) and seen.prompts[local] != row.get("prompt"):
            record["prompt"] = seen.prompts[local]
        if not record:
            return None
        return json.loads(json.dumps(record, allow_nan=False, default=_plain))  # a deep copy, as state.json saves it

    def _check_threshold(self, rewards: torch.Tensor, reward_weights: torch.Tensor, outcome) -> None:
        """Warn once per run when the success threshold does not separate this batch's rollouts (`threshold_mismatch`).
        Every rank holds the same gathered rewards; the main process speaks."""
        if "threshold" in self._warned or not self.state.ranks.is_main_process:
            return
        threshold = self.state.settings.success_reward_threshold
        message = threshold_mismatch(rewards, reward_weights, outcome.solved, threshold, self.state.num_generations)
        if message is not None:
            self._warn_once("threshold", message)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self.state.messages.warn(message)

    def _row_keys(self, output: dict[str, Any], batch: GenerationBatch, pending: PendingCollection) -> dict[str, Any]:
        """Per-row keys for the loss (`BatchKey`); TRL's shuffle and split of the batch carry them with every row."""
        device = output["completion_ids"].device
        rows = batch.rows
        num_local = len(rows.inputs)
        keys = {
            BatchKey.ROW: torch.arange(num_local, device=device),
            BatchKey.COLLECT: torch.tensor([i in pending.rows for i in range(num_local)], device=device),
        }
        # With offline guidance on, every batch of every rank carries the keys (the term's statistics are a
        # collective), offline rows with behaviour log-prob 0.
        if (batch.plan is not None and batch.plan.with_trajectories) or self.state.offline.active:
            behaviour = torch.zeros(output["completion_ids"].shape, dtype=torch.float32, device=device)  # (B, T)
            for local, j in enumerate(rows.replay_rows):
                if j >= 0:
                    logps = batch.plan.behaviour_logps[j]
                    behaviour[local, : logps.numel()] = logps.to(device)
            offline = [i in rows.offline for i in range(num_local)]
            keys[BatchKey.REPLAY_MASK] = torch.tensor(
                [j >= 0 or o for j, o in zip(rows.replay_rows, offline)], device=device
            )
            keys[BatchKey.BEHAVIOUR_LOGPS] = behaviour
            keys[BatchKey.OFFLINE] = torch.tensor(offline, dtype=torch.bool, device=device)
        return keys

    def _batch_metrics(self, plan: ReplayPlan | None, outcome, collecting: bool) -> None:
        state = self.state
        n_exp = len(plan.group_indices) if plan is not None else 0
        metrics = {"replay/fraction": n_exp / max(1, len(outcome.successes)), "batch/pass_at_1": outcome.pass_at_1}
        fresh = outcome.successes[: len(outcome.successes) - n_exp]  # the replayed groups are the last n_exp
        if fresh:  # fresh groups with no successful row: no gradient, nothing to store
            metrics["batch/fresh_all_fail"] = sum(1 for k in fresh if k == 0) / len(fresh)
        if plan is not None:
            metrics["replay/repeat_share"] = plan.repeat_share
        reuse = state.buffer.reuse() if collecting and state.settings.replays and state.ranks.is_main_process else None
        if reuse is not None:  # the main process draws: only its buffer knows the recent draws
            metrics["replay/reuse"] = reuse
        if plan is not None and plan.with_trajectories:  # generation batches since each was collected: one subtraction
            metrics["replay/age"] = sum(plan.clock - c for c in plan.collected_at) / len(plan.collected_at)
        if plan is not None and plan.uses:  # replays of each replayed trajectory, this one included
            metrics["replay/uses"] = sum(plan.uses) / len(plan.uses)
        if plan is not None and plan.selected_entropies:
            metrics["replay/selected_entropy"] = sum(plan.selected_entropies) / len(plan.selected_entropies)
        state.add_metrics(self.metrics, metrics)
        state.set_values({"replay/active": float(collecting)})  # a state: its value, never a window mean

    # ------------------------------------------------------------------------------------------ 4. loss passes
    def flush(self, keep_pending: bool = False) -> None:
        """Commit the pending batch outcome to the buffer. A collective: every rank calls it at the same point.

        With `keep_pending` (a checkpoint in the middle of a generation batch's first pass) the trajectories
        recorded so far are committed and the rest follow when the pass ends; group updates are idempotent, so
        applying them twice changes nothing.
        """
        pending, state = self.pending, self.state
        if pending is None:
            return
        if not keep_pending:
            self.pending = None
        gathered = state.ranks.gather_objects([(pending.groups, pending.take_recorded())])
        state.offline.note_self_solved(row.key for _, rows in gathered for row in rows)  # the `unsolved` rule
        commit(
            state.buffer, gathered, collected_at=pending.collected_at, is_main_process=state.ranks.is_main_process,
            k=state.num_generations,
        )  # fmt: skip

    def collects_in(self, inputs: dict[str, Any]) -> bool:
        """Whether this loss pass over `inputs` (a micro-batch) is a first pass whose rows' log-probs are recorded."""
        return self.pending is not None and self.pending.micro_batches_left > 0 and BatchKey.ROW in inputs

    def record_behaviour(self, inputs: dict[str, Any], per_token_logps: torch.Tensor) -> None:
        """The behaviour log-probs of the rows to store in this micro-batch (TRL's old log-probs, or this pass's own
        when TRL keeps none); the last first-pass micro-batch commits the batch (`flush`)."""
        pending = self.pending
        behaviour = inputs.get("old_per_token_logps")
        behaviour = per_token_logps.detach() if behaviour is None else behaviour  # (B, T)
        rows = inputs[BatchKey.ROW].tolist()
        tool_mask = inputs.get("tool_mask")  # (B, T): 0 where a tool or an environment inserted the token
        for position in inputs[BatchKey.COLLECT].nonzero().flatten().tolist():
            length = int(inputs["completion_mask"][position].sum())
            stored = pending.rows[rows[position]]
            stored.completion_ids = inputs["completion_ids"][position, :length].tolist()
            stored.mask = None if tool_mask is None else tool_mask[position, :length].tolist()
            stored.logps = behaviour[position, :length].float().cpu().tolist()
        pending.micro_batches_left -= 1
        if pending.micro_batches_left == 0:
            self.flush()

    def replay_term(
        self, inputs: dict[str, Any], per_token_logps: torch.Tensor, *, gradient_accumulation_steps: int
    ) -> torch.Tensor:
        """The shaped replayed-token loss of one micro-batch (algorithm §8), aggregated as TRL aggregates its own, and
        its statistics over every rank's replayed and offline tokens (one collective, on every rank)."""
        settings, ranks = self.state.settings, self.state.ranks
        replay_mask = inputs[BatchKey.REPLAY_MASK].unsqueeze(1)  # (B, 1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1)
        gamma = settings.policy_shaping_gamma
        per_token_loss, w, shaped = shaped_replay_token_loss(
            per_token_logps,
            inputs[BatchKey.BEHAVIOUR_LOGPS],
            advantages,
            gamma=gamma,
            importance_correction=settings.replay_importance_correction,
        )
        loss = aggregate_token_loss(
            per_token_loss * replay_mask,  # (B, T): fresh rows are TRL's
            mask,
            loss_type=self.rollouts.loss_type,
            max_completion_length=self.rollouts.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=ranks.num_processes,
            gradient_accumulation_steps=gradient_accumulation_steps,
            steps_per_generation=self.rollouts.steps_per_generation,
            training=True,
        )
        offline_flags = inputs.get(BatchKey.OFFLINE)  # (B,), present with offline guidance on
        offline_mask = (mask * offline_flags.unsqueeze(1)).bool() if offline_flags is not None else None  # (B, T)
        token_mask = (mask * replay_mask).bool()  # (B, T)
        if offline_mask is not None:
            token_mask = token_mask & ~offline_mask
        if self.replay_token_weights is not None:
            self.replay_token_weights.append(w[token_mask].float().cpu())
        local = ReplayTokenStats.of(w, shaped, token_mask, offline_mask, loss, gamma)
        rows = ranks.gather(local.as_row().unsqueeze(0)).cpu()  # (world, 9), on the host at once
        for name, value in ReplayTokenStats.figures(rows, gamma).items():
            self.metrics[METRIC_PREFIX + name].append(value)
        return loss
