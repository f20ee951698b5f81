"""`ExGRPORun`: ExGRPO's training state and the steps of one generation batch, free of the training loop.

No trl, transformers or accelerate imports (`scripts/check_imports.py` enforces it): what needs the model or the other
processes is passed in as callables (`Ranks`, the entropy scorer of `begin_batch`), so a run works on plain lists and
tensors in one process, as `tests/algorithm/test_run.py` drives it. `ExGRPOTrainer` builds one and calls it from TRL's
hooks; a feature that is off is a null object (`offline.NoOfflineGuide`), not a branch.

The state, saved with every checkpoint (`save`, `restore`; `state_dict` holds all but the buffer's arrays): the
experience buffer, the switches (replay active, generation batches so far), the sampler's place in its epochs and the
offline guide's verdicts. Beside it, what lives for one generation batch (`batch`, `pending`) and for the log (`latest`
figures, `last_plan`).

One training generation batch, in the order the trainer's hooks call the run (algorithm page, "How it works inside
TRL"):
1. `begin_batch`: commit what is still pending (`flush`), draw and score the replay plan (`make_plan`), give the rows
   to replayed questions (`assign_rows`) and offline solutions (`add_offline_rows`).
2. `scored`: what the reward functions saw, with the environment rewards of stored trajectories put back.
3. `after_scoring`: success per row, the collection to commit, the per-row keys of the loss, the delayed start, the
   batch's figures.
4. Each loss pass: `record_behaviour` (the first pass over each row; the last one commits it: `flush`) and
   `replay_term`, the shaped replayed-token loss.
"""

from __future__ import annotations

import collections
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .buffer import ExperienceBuffer, has_images, question_key, row_images, row_key
from .checkpoints import restore_state
from .loss import ReplayTokenStats, aggregate_token_loss, shaped_replay_token_loss
from .offline import NoOfflineGuide, OfflineGuide
from .replay import (
    PendingCollection,
    ReplayPlan,
    RowAssignment,
    assign_rows,
    batch_outcome,
    collect,
    commit,
    draw_replay_questions,
    replay_count,
    select_lowest,
    threshold_mismatch,
)
from .sampler import SkipRetiredSampler
from .state import save_state

logger = logging.getLogger(__name__)

METRIC_PREFIX = "exgrpo/"
GAUGES = ("replay/active", "offline/rejected")  # logged as their value, never a window mean
MAIN_ONLY = ("replay/reuse",)  # figures the main process alone computes (only its buffer knows the recent draws)


class BatchKey:
    """The per-row keys ExGRPO adds to the batch dict TRL's `_generate_and_score_completions` returns; TRL's shuffle
    and split of the batch carry them along with every row to `_compute_loss`."""

    ROW = "exgrpo_row"  # (B,) the row's index in this rank's generation batch
    COLLECT = "exgrpo_collect"  # (B,) its completion is stored once its behaviour log-probs are known
    REPLAY_MASK = "exgrpo_replay_mask"  # (B,) the row carries a stored trajectory
    BEHAVIOUR_LOGPS = "exgrpo_behaviour_logps"  # (B, T) the stored trajectory's behaviour log-probs, 0 elsewhere
    UNCLIPPED = "exgrpo_unclipped"  # (B,) generated after replay started: no PPO clip on its fresh tokens
    OFFLINE = "exgrpo_offline"  # (B,) the row carries an offline solution (in REPLAY_MASK too; behaviour log-prob 0)


@dataclass
class GenerationBatch:
    """What one training generation batch hands from hook to hook: made by `begin_batch`, filled by the hooks TRL
    calls while it generates and scores, and dropped (`ExGRPORun.batch = None`) when TRL returns."""

    plan: ReplayPlan | None  # what is replayed (the same on every rank)
    rows: RowAssignment  # this rank's rows: which carry a replayed question, which a stored trajectory
    turns: int = 0  # `_generate_single_turn` calls so far: the first is the first turn of every row
    # What TRL handed the reward functions (`scored`), this rank's rows, replayed ones included:
    completion_ids: list[list[int]] | None = None  # whole (multi-turn) completions
    prompts: list[Any] | None = None  # the prompts, as an environment's reset() may have completed them
    completions: list[Any] | None = None  # decoded completions (with a tool loop: its message lists)
    fields: list[dict[str, Any]] | None = None  # per row, the columns a rollout function added to the dataset row
    rewards: torch.Tensor | None = None  # (N_global, F): every rank's rewards, gathered


def _same(value):
    return value


@dataclass(frozen=True)
class Ranks:
    """The processes of a run, as the run needs them: one process by default. The trainer passes accelerate's."""

    process_index: int = 0
    num_processes: int = 1
    is_main_process: bool = True
    broadcast: Callable[[Any], Any] = _same  # the main process's object, on every rank
    gather_objects: Callable[[list], list] = _same  # every rank's list, concatenated in rank order
    gather: Callable[[torch.Tensor], torch.Tensor] = _same  # every rank's tensor, concatenated along dim 0


def dataset_keys(dataset) -> list[str]:
    """Each row's question key (`buffer.row_key`); a dataset without image columns is keyed by its prompts alone,
    read as one column (no row is built)."""
    if not has_images(getattr(dataset, "column_names", None) or []):
        return [question_key(prompt) for prompt in dataset["prompt"]]
    return [row_key(row) for row in dataset]


def _plain(value):
    """JSON fallback for what reward functions see: numpy and torch values as plain numbers and lists."""
    if isinstance(value, (np.generic, np.ndarray, torch.Tensor)):
        return value.tolist()
    raise TypeError(f"a value of type {type(value).__name__}")


class ExGRPORun:
    """ExGRPO's state in one training run, and the steps of each generation batch (module docstring).

    Args:
        cfg: the run's `ExGRPOConfig` (read, never changed).
        num_generations: K, rollouts per question.
        max_completion_length: the longest completion, in tokens (offline solutions longer are not used).
        loss_type: TRL's loss type (the replayed-token term is aggregated as TRL aggregates its own).
        tokenize_completion: `text -> token ids` as the model's completion of its prompt would be (text, then EOS).
        stop_ids: the ids a completion the model ended ends with (EOS ids and pad).
        reward_names: each reward column's name; `env_reward_columns` those an environment owns (`get_reward`).
        keeps_messages: a tool loop runs: a stored trajectory keeps its message list.
        ranks: the processes (`Ranks`).
        metrics: where the batch figures go, a mapping of name -> list (TRL's training metrics: averaged over the
            logging window, then cleared).
        warn, info: where the run's messages go.
    """

    def __init__(
        self,
        cfg,
        *,
        num_generations: int,
        max_completion_length: int,
        loss_type: str,
        tokenize_completion: Callable[[str], list[int]],
        stop_ids: set[int],
        reward_names: Sequence[str] = (),
        env_reward_columns: Sequence[int] = (),
        keeps_messages: bool = False,
        ranks: Ranks = Ranks(),
        metrics: dict[str, list[float]] | None = None,
        warn: Callable[[str], None] = logger.warning,
        info: Callable[[str], None] = logger.info,
    ):
        self.cfg, self.k, self.ranks = cfg, num_generations, ranks
        self.max_completion_length, self.loss_type = max_completion_length, loss_type
        self.tokenize_completion, self.stop_ids = tokenize_completion, set(stop_ids)
        self.reward_names, self.env_reward_columns = list(reward_names), list(env_reward_columns)
        self.keeps_messages = keeps_messages
        self.metrics = collections.defaultdict(list) if metrics is None else metrics
        self.warn, self.info = warn, info
        self.buffer = ExperienceBuffer(
            num_generations,
            mu=cfg.replay_mu,
            sigma=cfg.replay_sigma,
            question_selection=cfg.question_selection,
            seed=cfg.seed,
            cooldown=cfg.replay_cooldown,
        )
        self.offline: OfflineGuide | NoOfflineGuide = NoOfflineGuide()
        if cfg.offline_solutions_column is not None:  # reference solutions as each fresh group's first row
            self.offline = OfflineGuide(
                cfg.offline_solutions_column, cfg.offline_guidance, max_completion_length, tokenize_completion
            )
        self.switches = {"replay_active": not cfg.replay_start_pass_rate, "generation_batches": 0}
        self.sampler: SkipRetiredSampler | None = None
        self.batch: GenerationBatch | None = None  # the generation batch being generated and scored
        self.pending: PendingCollection | None = None  # its outcome, until committed to the buffer
        self.last_plan: ReplayPlan | None = None  # the last training generation batch's (None: nothing replayed)
        # Set to a list to receive, per loss pass, the importance weights w of this rank's replayed tokens (1-D,
        # detached, on the CPU): the distribution behind the logged means. None: nothing is kept.
        self.replay_token_weights: list[torch.Tensor] | None = None
        self.latest: dict[str, float] = {}  # the latest generation batch's figures (`fill_log`)
        self._warned: set[str] = set()  # the messages said once per run

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The switches, the sampler's place, the offline guide's verdicts and the latest figures (the buffer is saved
        beside them), and the number of processes that saved it: a checkpoint is complete when each of them wrote its
        own files (`checkpoints.checkpoint_problems`)."""
        state = dict(self.switches)
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        offline = self.offline.state_dict()
        if offline is not None:
            state["offline"] = offline
        # the log rows after a resume carry them as the uninterrupted run's do (`fill_log`)
        state["latest"] = dict(self.latest)
        state["num_processes"] = self.ranks.num_processes
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Read back what `state_dict` saved; a state saved by an older version (no latest figures, no sampler state,
        no number of processes) loads too. The number of processes is the saving run's, not restored."""
        not_switches = ("sampler", "sampler_passes", "offline", "latest", "num_processes")
        self.switches.update({k: v for k, v in state.items() if k not in not_switches})
        latest = state.get("latest") or {}  # the main process's: the others never had its own figures
        self.latest.update({k: v for k, v in latest.items() if self.ranks.is_main_process or k not in MAIN_ONLY})
        self.offline.load_state_dict(state.get("offline", {}))
        if self.sampler is not None:
            # checkpoints before the sampler's state was saved hold the current epoch's passes only
            self.sampler.load_state_dict(
                state.get("sampler") or {"epoch": None, "passes": state.get("sampler_passes", [])}
            )

    def save(self, checkpoint: str) -> None:
        """The buffer and `state_dict` into `checkpoint`'s state folder (call `flush(keep_pending=True)` first)."""
        save_state(checkpoint, self.buffer, self.state_dict())

    def restore(self, checkpoint: str) -> None:
        """The state saved in `checkpoint`; a checkpoint without ExGRPO state (plain GRPO's) leaves it as it is."""
        saved = restore_state(
            checkpoint,
            self.buffer,
            num_generations=self.k,
            is_main_process=self.ranks.is_main_process,
            warn=self.warn,
        )
        if saved is not None:
            self.load_state_dict(saved)

    def seed_buffer(self, path: str, *, fingerprint: str, progress: bool = True) -> None:
        """`initial_experience`: fill the buffer from an `exgrpo export` (`export.seed_buffer`). Every rank checks the
        export's num_generations (one small file read, no collective); only the main process, which holds the
        trajectories, reads the rows: the other ranks need the retired set only, and an export carries none. A
        resume replaces the seeded buffer with the checkpoint's (`restore`). `fingerprint`: this run's tokenizer's."""
        from .export import read_export_meta, seed_buffer

        meta = read_export_meta(path, num_generations=self.k)
        if not self.ranks.is_main_process:
            return
        report = seed_buffer(
            self.buffer,
            path,
            fingerprint=fingerprint,
            tokenize=self.tokenize_completion,
            max_length=self.max_completion_length,
            meta=meta,
            progress=progress,
        )
        skipped = report.skipped()
        if skipped:
            self.warn(f"ExGRPO: initial_experience {path}: left out {skipped}.")
        how = (
            "tokenized again with this run's tokenizer (the export's differs), as offline trajectories"
            if report.retokenized
            else "with their token ids and behaviour log-probs"
        )
        self.info(
            f"ExGRPO: seeded the experience buffer from {path}: {report.questions} questions, "
            f"{report.trajectories} trajectories, {how}."
        )

    def wrap_sampler(self, inner, dataset) -> SkipRetiredSampler:
        """TRL's sampler over `dataset`, wrapped so that retired questions are skipped and its place is saved (with
        nothing to skip it yields exactly TRL's indices). A sampler rebuilt after a resume keeps the restored place."""
        retired = self.buffer.retired if self.cfg.skips_retired else set()
        sampler = SkipRetiredSampler(inner, lambda: dataset_keys(dataset), retired)
        if self.sampler is not None and self.sampler.resume is not None:
            sampler.resume = self.sampler.resume
        self.sampler = sampler
        return sampler

    # ------------------------------------------------------------------------------------------ 1. the plan
    def begin_batch(self, inputs: Sequence[dict], score: Callable[..., torch.Tensor]) -> GenerationBatch:
        """Step 1: this rank's `inputs` (its share of the generation batch) with the plan applied. `score(rows,
        prompts, completion_ids, masks)`: the mean entropy of each candidate under the current policy, the same on
        every rank (a collective: every rank calls it, with the same candidates)."""
        self.flush()  # normally already done after the first loss pass; a no-op then
        num_groups = len(inputs) * self.ranks.num_processes // self.k
        plan = self.last_plan = self.make_plan(num_groups, score)
        rows = self.assign_rows(inputs, plan)
        self.add_offline_rows(rows, plan)
        self.batch = GenerationBatch(plan, rows)
        return self.batch

    def make_plan(self, num_groups: int, score: Callable[..., torch.Tensor]) -> ReplayPlan | None:
        """Draw the replayed questions on the main process, broadcast them, and select one trajectory per question:
        the lowest (or highest) mean entropy under the current policy among its candidates (algorithm §5-6)."""
        cfg = self.cfg
        if not (self.switches["replay_active"] and cfg.replays):
            return None
        drawn = None
        if self.ranks.is_main_process:
            n_exp = replay_count(self.buffer.num_questions, cfg.replay_ratio, num_groups)
            # The stored arrays themselves (int32 ids, float16 log-probs) are pickled as raw bytes for the broadcast,
            # where Python lists cost ~5x the time and twice the bytes (see benchmarks/buffer_memory.py).
            drawn = draw_replay_questions(
                self.buffer,
                n_exp,
                trajectory_selection=cfg.trajectory_selection,
                max_candidates=cfg.max_trajectory_candidates,
            )
        drawn = self.ranks.broadcast(drawn)
        if not drawn:
            return None
        # Entropy scoring of every candidate of the questions that have more than one (all ranks, sharded).
        scored = [i for i, question in enumerate(drawn) if len(question.candidates) > 1]
        chosen = [0] * len(drawn)
        selected_entropies = []
        if scored and cfg.trajectory_selection != "random" and cfg.replay_stored_trajectory:
            # each candidate under the prompt it was sampled with (an environment's reset() may have completed it)
            candidates = [(drawn[i].row, c) for i in scored for c in drawn[i].candidates]
            entropies = score(
                [row for row, _ in candidates],
                [(c.record or {}).get("prompt", row["prompt"]) for row, c in candidates],
                [c.completion_ids for _, c in candidates],
                [c.mask for _, c in candidates],  # None: every token is the model's (single-turn)
            )
            start = 0
            for i in scored:
                scores = entropies[start : start + len(drawn[i].candidates)]
                chosen[i] = select_lowest(scores, highest=cfg.trajectory_selection == "highest_entropy")
                selected_entropies.append(float(scores[chosen[i]]))
                start += len(drawn[i].candidates)
        return ReplayPlan.build(drawn, chosen, num_groups, selected_entropies, cfg.replay_stored_trajectory)

    def assign_rows(self, inputs: Sequence[dict], plan: ReplayPlan | None) -> RowAssignment:
        """This rank's rows with the plan applied (`replay.assign_rows`)."""
        return assign_rows(inputs, plan, process_index=self.ranks.process_index, k=self.k)

    def add_offline_rows(self, rows: RowAssignment, plan: ReplayPlan | None) -> None:
        """Each fresh group's first row held here gets its question's offline solution, if any (`OfflineGuide`)."""
        self.offline.add_rows(
            rows, plan, process_index=self.ranks.process_index, k=self.k, retired=self.buffer.retired
        )

    # ------------------------------------------------------------------------------------------ 2. scored
    def scored(self, batch: GenerationBatch, inputs, prompts, completions, completion_ids, rewards) -> None:
        """Step 2, once the reward functions have run: keep what they saw (the rows TRL handed them, with the fields
        a rollout function added, `rewards` gathered over ranks), and give a stored trajectory's environment-owned
        rewards (`get_reward`) back to its replayed row: its tool calls are not run again, so its environment is only
        reset and would score it afresh."""
        plan = batch.plan
        if plan is not None and plan.with_trajectories and self.env_reward_columns:
            for j, group in enumerate(plan.group_indices):
                stored = plan.record(j).get("rewards", {})
                for column in self.env_reward_columns:
                    name = self.reward_names[column]
                    if name in stored:
                        value = stored[name]
                        rewards[group * self.k, column] = math.nan if value is None else value
        batch.rewards = rewards
        batch.completion_ids = [list(ids) for ids in completion_ids]
        batch.prompts, batch.completions = list(prompts), list(completions)
        batch.fields = [{k: v for k, v in x.items() if k not in row} for x, row in zip(inputs, batch.rows.inputs)]

    # ------------------------------------------------------------------------------------------ 3. after scoring
    def after_scoring(
        self,
        batch: GenerationBatch,
        output: dict[str, Any],
        *,
        reward_weights: torch.Tensor,
        micro_batches_left: int,
        step: int,
    ) -> None:
        """Step 3, on TRL's scored batch `output` (this rank's rows): outcomes, the offline verdicts, the collection
        (committed once the behaviour log-probs are known), per-row keys for the loss, the delayed start, figures.
        `micro_batches_left`: loss passes until every row has been seen once; `step`: the global step."""
        cfg = self.cfg
        outcome = batch_outcome(batch.rewards, reward_weights, cfg.success_reward_threshold, self.k)
        self._check_threshold(batch.rewards, reward_weights, outcome)
        self._figures(self.offline.judge(batch.rows, outcome, output["advantages"], self.ranks.gather_objects))
        self.latest.update(self.offline.gauges())
        if self.offline.too_long:
            self._warn_once(
                "too long",
                f"ExGRPO: {len(self.offline.too_long)} offline solution(s) are longer than max_completion_length "
                f"({self.max_completion_length} tokens) once tokenized and are not used",
            )
        collecting = self.switches["replay_active"]  # the state this batch was generated under
        tool_mask = output.get("tool_mask")  # (B, T): 0 where a tool or an environment inserted the token
        masks = None
        if tool_mask is not None:
            masks = [tool_mask[i, : len(ids)].tolist() for i, ids in enumerate(batch.completion_ids)]
        pending = self.pending = collect(
            batch.rows,
            outcome,
            batch.completion_ids,
            process_index=self.ranks.process_index,
            k=self.k,
            collecting=collecting,
            stop_ids=self.stop_ids,
            micro_batches_left=micro_batches_left,
            step=step,
            masks=masks,
        )
        for local in list(pending.rows):
            try:
                pending.rows[local].record = self.row_record(batch, local)
            except (TypeError, ValueError) as e:  # what the reward functions saw of it cannot be saved: not stored
                del pending.rows[local]
                self._warn_once(
                    "record",
                    f"ExGRPO: a successful rollout is not stored: what its reward functions saw is not JSON ({e})",
                )
        self._add_row_keys(output, batch, pending)
        # generated after replay started (never with replay_ratio 0): no clip on fresh tokens
        if cfg.remove_clip_after_replay_start and collecting and cfg.replays:
            output[BatchKey.UNCLIPPED] = torch.ones(
                len(batch.rows.inputs), dtype=torch.bool, device=outcome.solved.device
            )
        # The delayed start (algorithm §7): judged on a purely on-policy batch, effective from the next one; stays on.
        threshold = cfg.replay_start_pass_rate or 0.0
        if not self.switches["replay_active"] and outcome.pass_at_1 > threshold:
            self.switches["replay_active"] = True
            self.info(f"ExGRPO: batch Pass@1 {outcome.pass_at_1:.3f} > {threshold}: replay starts.")
        self.switches["generation_batches"] += 1
        self._batch_figures(batch.plan, outcome, collecting)

    def row_record(self, batch: GenerationBatch, local: int) -> dict[str, Any] | None:
        """What the reward functions were given for this rank's row `local` beyond its token ids, for a replay to
        give them again without running a tool or an environment (`Trajectory.record`): the message list of a tool
        loop, environment-owned rewards, a rollout function's per-row fields, the prompt as an environment's reset()
        completed it. None when there is nothing of the kind (single-turn training); TypeError or ValueError when it
        is not JSON."""
        record: dict[str, Any] = {}
        if self.keeps_messages:
            record["completion"] = batch.completions[local]
        if self.env_reward_columns:
            row = self.ranks.process_index * len(batch.rows.inputs) + local
            values = [batch.rewards[row, c].item() for c in self.env_reward_columns]
            names = [self.reward_names[c] for c in self.env_reward_columns]
            record["rewards"] = {name: None if math.isnan(v) else v for name, v in zip(names, values)}
        if batch.fields[local]:
            record["fields"] = batch.fields[local]
        row = batch.rows.inputs[local]
        # TRL's prompt of a row with images holds them (not JSON); an environment cannot complete it (rejected at init)
        if not row_images(row) and batch.prompts[local] != row.get("prompt"):
            record["prompt"] = batch.prompts[local]
        if not record:
            return None
        return json.loads(json.dumps(record, allow_nan=False, default=_plain))  # a deep copy, as state.json saves it

    def _check_threshold(self, rewards: torch.Tensor, reward_weights: torch.Tensor, outcome) -> None:
        """Warn once per run when the success threshold does not separate this batch's rollouts (`threshold_mismatch`).
        Every rank holds the same gathered rewards; the main process speaks."""
        if "threshold" in self._warned or not self.ranks.is_main_process:
            return
        message = threshold_mismatch(
            rewards, reward_weights, outcome.solved, self.cfg.success_reward_threshold, self.k
        )
        if message is not None:
            self._warn_once("threshold", message)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self.warn(message)

    def _add_row_keys(self, output: dict[str, Any], batch: GenerationBatch, pending: PendingCollection) -> None:
        """Per-row keys for the loss (`BatchKey`); TRL's shuffle and split of the batch carry them with every row."""
        device = output["completion_ids"].device
        num_local = len(batch.rows.inputs)
        output[BatchKey.ROW] = torch.arange(num_local, device=device)
        output[BatchKey.COLLECT] = torch.tensor([i in pending.rows for i in range(num_local)], device=device)
        # With offline guidance on, every batch of every rank carries the keys (the term's statistics are a
        # collective), offline rows with behaviour log-prob 0.
        if (batch.plan is not None and batch.plan.with_trajectories) or self.offline.active:
            replay_rows = batch.rows.replay_rows
            behaviour = torch.zeros(output["completion_ids"].shape, dtype=torch.float32, device=device)  # (B, T)
            for local, j in enumerate(replay_rows):
                if j >= 0:
                    logps = batch.plan.behaviour_logps[j]
                    behaviour[local, : logps.numel()] = logps.to(device)
            offline = [i in batch.rows.offline for i in range(num_local)]
            output[BatchKey.REPLAY_MASK] = torch.tensor(
                [j >= 0 or o for j, o in zip(replay_rows, offline)], device=device
            )
            output[BatchKey.BEHAVIOUR_LOGPS] = behaviour
            output[BatchKey.OFFLINE] = torch.tensor(offline, dtype=torch.bool, device=device)

    def _batch_figures(self, plan: ReplayPlan | None, outcome, collecting: bool) -> None:
        n_exp = len(plan.group_indices) if plan is not None else 0
        figures = {"replay/fraction": n_exp / max(1, len(outcome.successes)), "batch/pass_at_1": outcome.pass_at_1}
        fresh = outcome.successes[: len(outcome.successes) - n_exp]  # the replayed groups are the last n_exp
        if fresh:  # fresh groups with no successful row: no gradient, nothing to store
            figures["batch/fresh_all_fail"] = sum(1 for k in fresh if k == 0) / len(fresh)
        if plan is not None:
            figures["replay/repeat_share"] = plan.repeat_share
        reuse = self.buffer.reuse() if collecting and self.cfg.replays and self.ranks.is_main_process else None
        if reuse is not None:  # the main process draws: only its buffer knows the recent draws (MAIN_ONLY)
            figures["replay/reuse"] = reuse
        if plan is not None and plan.selected_entropies:
            figures["replay/selected_entropy"] = sum(plan.selected_entropies) / len(plan.selected_entropies)
        self._figures(figures)
        self.latest["replay/active"] = float(collecting)  # a switch: its value, never a window mean

    def _figures(self, figures: dict[str, float]) -> None:
        """A generation batch's figures: into the metrics (averaged over the logging window), and kept as the latest
        values for the log rows whose window holds no generation batch (`fill_log`)."""
        for name, value in figures.items():
            self.metrics[METRIC_PREFIX + name].append(float(value))
        self.latest.update({name: float(value) for name, value in figures.items()})

    def fill_log(self) -> None:
        """Before a training log row is written: every ExGRPO metric in it, counts and switches as their value now
        (the buffer's as it is), the generation batch's figures as the latest batch's when none fell in the window."""
        metrics = self.metrics
        for name, value in self.latest.items():
            if not metrics.get(METRIC_PREFIX + name) or name in GAUGES:
                metrics[METRIC_PREFIX + name] = [value]
        if self.ranks.is_main_process:  # only the main process holds the buffer's trajectories
            buffer = self.buffer
            gauges = {"questions": buffer.num_questions, "trajectories": buffer.num_trajectories,
                      "retired": len(buffer.retired)}  # fmt: skip
            gauges.update({f"bucket_{k}": count for k, count in buffer.bucket_counts().items()})
            for name, value in gauges.items():
                metrics[f"{METRIC_PREFIX}buffer/{name}"] = [float(value)]

    # ------------------------------------------------------------------------------------------ 4. loss passes
    def flush(self, keep_pending: bool = False) -> None:
        """Commit the pending batch outcome to the buffer. A collective: every rank calls it at the same point.

        With `keep_pending` (a checkpoint in the middle of a generation batch's first pass) the trajectories
        recorded so far are committed and the rest follow when the pass ends; group updates are idempotent, so
        applying them twice changes nothing.
        """
        pending = self.pending
        if pending is None:
            return
        if not keep_pending:
            self.pending = None
        gathered = self.ranks.gather_objects([(pending.groups, pending.take_recorded())])
        self.offline.note_self_solved(row.key for _, rows in gathered for row in rows)  # the `unsolved` rule
        commit(self.buffer, gathered, step=pending.step, is_main_process=self.ranks.is_main_process, k=self.k)

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
        cfg = self.cfg
        replay_mask = inputs[BatchKey.REPLAY_MASK].unsqueeze(1)  # (B, 1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1)
        gamma = cfg.policy_shaping_gamma
        per_token_loss, w, shaped = shaped_replay_token_loss(
            per_token_logps,
            inputs[BatchKey.BEHAVIOUR_LOGPS],
            advantages,
            gamma=gamma,
            importance_correction=cfg.replay_importance_correction,
        )
        loss = aggregate_token_loss(
            per_token_loss * replay_mask,  # (B, T): fresh rows are TRL's
            mask,
            loss_type=self.loss_type,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.ranks.num_processes,
            gradient_accumulation_steps=gradient_accumulation_steps,
            steps_per_generation=cfg.steps_per_generation,
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
        rows = self.ranks.gather(local.as_row().unsqueeze(0)).cpu()  # (world, 9), on the host at once
        for name, value in ReplayTokenStats.figures(rows, gamma).items():
            self.metrics[METRIC_PREFIX + name].append(value)
        return loss
