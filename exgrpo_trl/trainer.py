"""`ExGRPOTrainer`: TRL's GRPOTrainer with ExGRPO's experience replay (arXiv 2510.02245)."""

from __future__ import annotations

import inspect
import math
import os
import textwrap
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from .buffer import ExperienceBuffer, Trajectory, question_key, shortlist_candidates
from .card import add_section, exgrpo_card_section
from .config import ExGRPOConfig
from .loss import SUPPORTED_LOSS_TYPES, aggregate_token_loss, shaped_replay_token_loss
from .scoring import masked_mean_per_row, pad_prompt_completion
from .state import has_state, load_state, save_state

logger = logging.get_logger(__name__)

METRIC_PREFIX = "exgrpo/"
# Rows per entropy-scoring forward pass (see `_exgrpo_mean_entropies`). Scoring 94 stored trajectories on the
# benchmark's CPU model took 62.8 ms in chunks of 16, 55.6 ms in chunks of 32 and 60.0 ms in chunks of 48.
SCORING_CHUNK_ROWS = 32
REPLAYED_COLUMN = "exgrpo_replayed"  # column of the completions table marking replayed rows


@dataclass
class _ReplayPlan:
    """What one generation batch replays, identical on every rank."""

    group_indices: list[int]  # global group indices whose K rows are given to replayed questions
    keys: list[str]
    rows: list[dict[str, Any]]
    completion_ids: list[list[int]]  # the selected stored trajectory of each replayed group
    behaviour_logps: list[torch.Tensor]  # (L,) float32 each
    num_groups: int  # groups in the whole generation batch
    selected_entropies: list[float] = field(default_factory=list)  # of the scored (>= 2 candidates) questions


@dataclass
class _PendingCollection:
    """One generation batch's outcome on this rank, committed to the buffer after the first loss pass."""

    groups: list[tuple[int, str, int, dict[str, Any] | None]]  # (global group, key, k, row or None)
    row_keys: dict[int, tuple[int, str]]  # local row -> (global row, key), rows whose trajectory will be stored
    trajectories: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)  # local row -> (ids, logps)
    micro_batches_left: int = 0
    step: int = 0


class _SkipRetiredSampler(torch.utils.data.Sampler):
    """Wraps TRL's RepeatSampler so that fresh questions are drawn only among those not retired (SPEC §4).

    The inner sampler permutes `num_samples` positions with its own generator; we point those positions at the rows
    that were not retired when the pass began, so the ordering logic stays TRL's own. An epoch keeps its nominal
    number of batches (the Trainer sized the run from it, so `max_steps` is honoured): when the remaining questions
    run out, a new pass over them begins. The questions excluded in each pass of the current epoch are part of the
    checkpoint, so a resumed run replays the epoch's order exactly.
    """

    def __init__(self, inner, prompts_fn, retired: set[str]):
        self.inner = inner
        self._prompts_fn = prompts_fn
        self._keys: list[str] | None = None
        self.retired = retired
        self.passes: list[frozenset[str]] = []  # questions excluded by each pass of the current epoch
        self.resume_passes: list[frozenset[str]] | None = None  # set on resume, used by the next epoch's passes

    def __len__(self):
        return len(self.inner)

    def __iter__(self):
        resume, self.resume_passes = self.resume_passes or [], None
        self.passes = []
        nominal, produced, full = len(self.inner), 0, self.inner.num_samples
        while produced < nominal:
            excluded = resume[len(self.passes)] if len(self.passes) < len(resume) else frozenset(self.retired)
            self.passes.append(excluded)
            active = range(full)
            if excluded:
                if self._keys is None:
                    self._keys = [question_key(p) for p in self._prompts_fn()]
                active = [i for i, key in enumerate(self._keys) if key not in excluded]
                if len(active) < self.inner.batch_size:
                    logger.warning(
                        f"ExGRPO: only {len(active)} questions are not retired, fewer than one batch "
                        f"({self.inner.batch_size}); drawing from the whole dataset again."
                    )
                    active = range(full)
            self.inner.num_samples = len(active)
            try:
                for position in self.inner:
                    yield active[position]
                    produced += 1
                    if produced == nominal:
                        return
            finally:
                self.inner.num_samples = full


class ExGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that learns from its own past successes (ExGRPO, arXiv 2510.02245).

    Successful rollouts go into an :class:`~exgrpo_trl.ExperienceBuffer`; every generation batch, a fraction
    `replay_ratio` of its questions are drawn from the buffer (favouring medium difficulty), each with its
    lowest-entropy stored trajectory, which joins K-1 fresh rollouts of the same question in one GRPO group. Replayed
    tokens are weighted by the shaped importance weight f(w) = w / (w + gamma), with no clipping. With
    `replay_ratio=0` training is exactly GRPOTrainer's (the buffer is still tracked, for statistics).

    The constructor is GRPOTrainer's; `args` must be an :class:`~exgrpo_trl.ExGRPOConfig`.

    Hooks overridden, each calling `super()`:
    - `_get_train_sampler`: wraps TRL's RepeatSampler to skip retired questions from the next epoch on.
    - `_generate_and_score_completions`: before `super()`, builds the replay plan (questions sampled on the main
      process and broadcast; stored trajectories scored for entropy on every rank, the same number of forward
      passes each) and gives the K rows of each replayed group to the stored question; after `super()`, reads each
      group's success count, schedules collection and retirement, checks the delayed start, adds per-row keys
      (replay mask, behaviour log-probs) to the batch, and logs `exgrpo/...` metrics.
    - `_generate_single_turn`: splices the selected stored trajectory into the reserved row of its group right after
      generation, before decoding, so TRL's own padding, rewards, advantages and masks see the whole mixed group.
    - `_calculate_rewards`: keeps the rewards it gathers across ranks (success counts come from them).
    - `_get_per_token_logps_and_entropies`: keeps the policy's log-probs of the loss pass, so the replayed-token
      term and the behaviour log-probs reuse TRL's forward pass instead of running another.
    - `_save_checkpoint` / `_load_optimizer_and_scheduler`: the buffer and ExGRPO's switches are written into
      each checkpoint folder (safetensors + JSON, atomically) before `super()` saves the rest and may push it, and
      restored on every rank on resume.
    - `create_model_card`: `super()` writes TRL's card (ExGRPO's name, tags and citation come from the class
      attributes); an ExGRPO section with the main settings and the final buffer is added to it.
    - `_compute_loss`: `super()` computes TRL's loss with the replayed rows' advantages set to 0 (their tokens then
      add nothing but still count in the normaliser); the shaped replayed-token term -f(w) * A is added with the
      same normaliser. During the first pass over a generation batch it also records the behaviour log-probs of
      the trajectories to store (TRL's old log-probs, or the detached log-probs of this pass when TRL skips them).

    Not supported yet (rejected at init): tools, `environment_factory`, `rollout_func`, image inputs. Replayed
    tokens are not affected by `top_entropy_quantile`, `off_policy_mask_threshold` or sequence-level importance
    sampling, which apply to fresh tokens as in TRL.
    """

    _tag_names = ["trl", "grpo", "exgrpo"]
    _name = "ExGRPO"
    _paper = {
        "title": "ExGRPO: Learning to Reason from Experience",
        "id": "2510.02245",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{zhan2025exgrpo,
                title        = {{ExGRPO: Learning to Reason from Experience}},
                author       = {Runzhe Zhan and Yafu Li and Zhi Wang and Xiaoye Qu and Dongrui Liu and Jing Shao and Derek F. Wong and Yu Cheng},
                year         = 2025,
                eprint       = {arXiv:2510.02245},
            }"""),
    }

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs)
        params = bound.arguments
        for name in ("tools", "rollout_func", "environment_factory"):
            if params.get(name):
                raise NotImplementedError(
                    f"ExGRPOTrainer does not support `{name}` yet: replaying stored trajectories through tool calls "
                    "or custom rollouts is not implemented. Use GRPOTrainer for this setup."
                )
        config = params.get("args")
        if config is None:
            params["args"] = ExGRPOConfig("ExGRPO")
        elif not isinstance(config, ExGRPOConfig):
            kind = "a GRPOConfig" if isinstance(config, GRPOConfig) else type(config).__name__
            raise TypeError(
                f"ExGRPOTrainer needs an ExGRPOConfig, got {kind}. Build one with the same fields, e.g. "
                "`ExGRPOConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init})`."
            )
        columns = getattr(params.get("train_dataset"), "column_names", None) or []
        if "image" in columns or "images" in columns:
            raise NotImplementedError("ExGRPOTrainer does not support image inputs yet.")

        params.pop("self")
        super().__init__(**params)

        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(f"ExGRPOTrainer supports loss_type in {SUPPORTED_LOSS_TYPES}, got {self.loss_type!r}")
        cfg: ExGRPOConfig = self.args
        self.experience_buffer = ExperienceBuffer(
            self.num_generations,
            mu=cfg.replay_mu,
            sigma=cfg.replay_sigma,
            question_selection=cfg.question_selection,
            seed=cfg.seed,
        )
        # Training state beside the buffer (persisted with checkpoints).
        self.exgrpo_state = {"replay_active": not cfg.replay_start_pass_rate, "generation_batches": 0}
        self._exgrpo_splice: dict[int, list[int]] | None = None  # local row -> stored completion ids
        self._exgrpo_rewards: torch.Tensor | None = None  # (N_global, F) of the last training batch
        self._exgrpo_completion_ids: list[list[int]] | None = None  # local completions after splicing
        self._exgrpo_pending: _PendingCollection | None = None
        self._exgrpo_capture = False
        self._exgrpo_captured_logps: torch.Tensor | None = None
        self._exgrpo_sampler: _SkipRetiredSampler | None = None

    # ------------------------------------------------------------------------------------------ data
    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        if self.args.replay_ratio > 0 and self.args.skip_retired_questions:
            dataset = self.train_dataset if dataset is None else dataset
            sampler = _SkipRetiredSampler(sampler, lambda: dataset["prompt"], self.experience_buffer.retired)
            previous = getattr(self, "_exgrpo_sampler", None)
            if previous is not None and previous.resume_passes is not None:
                sampler.resume_passes = previous.resume_passes
            self._exgrpo_sampler = sampler
        return sampler

    # ------------------------------------------------------------------------------------------ generation
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        splice = self._exgrpo_splice or {}
        rows = list(range(len(prompt_ids)))
        if self._exgrpo_can_skip_spliced_rows(prompt_ids, images, multimodal_fields):
            rows = [i for i in rows if i not in splice]  # do not sample a completion only to discard it
        completion_ids, logprobs = super()._generate_single_turn(
            [prompt_ids[i] for i in rows], images, multimodal_fields, num_generations, has_tool_images
        )
        if splice:
            full_ids = [None] * len(prompt_ids)
            full_logprobs = None if logprobs is None else [None] * len(prompt_ids)
            for j, i in enumerate(rows):
                full_ids[i] = completion_ids[j]
                if full_logprobs is not None:
                    full_logprobs[i] = logprobs[j]
            for row, ids in splice.items():
                full_ids[row] = list(ids)
                if full_logprobs is not None:
                    # None becomes NaN in TRL, and NaN an importance ratio of exactly 1: vLLM's sampling
                    # correction leaves the replayed row alone (its own weight is applied in the loss).
                    full_logprobs[row] = [None] * len(ids)
            completion_ids, logprobs = full_ids, full_logprobs
        if self.model.training:
            self._exgrpo_completion_ids = [list(ids) for ids in completion_ids]
        return completion_ids, logprobs

    def _exgrpo_can_skip_spliced_rows(self, prompt_ids, images, multimodal_fields) -> bool:
        """Whether the rows a stored trajectory takes can be left out of generation.

        Generation backends that take one prompt per row and run no collective tied to the row count can skip them:
        `generate` (under ZeRO-3 it syncs decoding steps, not rows), continuous batching, and colocated vLLM without
        tensor parallelism. vLLM server mode asks the server for exactly K completions of each distinct prompt, and
        colocated tensor parallelism slices equal shares per rank, so there every row is generated and the spliced
        ones discarded. A rank never drops all of its rows.
        """
        splice = self._exgrpo_splice
        if not splice or images is not None or multimodal_fields or len(splice) >= len(prompt_ids):
            return False
        return not (self.use_vllm and (self.vllm_mode != "colocate" or self.vllm_tensor_parallel_size > 1))

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.model.training:
            self._exgrpo_rewards = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation never replays and never collects
            return super()._generate_and_score_completions(inputs)

        self._exgrpo_flush()  # normally already done after the first loss pass; a no-op then
        num_local = len(inputs)
        plan = self._exgrpo_make_plan(num_local)
        inputs, replay_rows = self._exgrpo_apply_plan(inputs, plan)
        self._pending_extra_logs[REPLAYED_COLUMN].extend(replay_rows[i] >= 0 for i in range(num_local))

        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._exgrpo_splice = None
        self._exgrpo_after_scoring(inputs, output, plan, replay_rows)
        return output

    # ------------------------------------------------------------------------------------------ replay plan
    def _exgrpo_make_plan(self, num_local: int) -> _ReplayPlan | None:
        """Sample replayed questions on the main process, broadcast them, and select one trajectory per question."""
        cfg: ExGRPOConfig = self.args
        num_groups = num_local * self.accelerator.num_processes // self.num_generations
        if not (self.exgrpo_state["replay_active"] and cfg.replay_ratio > 0):
            return None
        payload = None
        if self.accelerator.is_main_process:
            n_exp = min(self.experience_buffer.num_questions, math.floor(cfg.replay_ratio * num_groups + 1e-9))
            payload = []
            for key in self.experience_buffer.sample_questions(n_exp):
                entry = self.experience_buffer.questions[key]
                candidates = entry.trajectories  # oldest first
                if cfg.trajectory_selection == "random":  # no scoring, so no shortlist: uniform over all
                    if len(candidates) > 1:
                        candidates = [candidates[self.experience_buffer.choose_random(len(candidates))]]
                else:
                    candidates = shortlist_candidates(
                        candidates, cfg.max_trajectory_candidates, cfg.trajectory_selection == "highest_entropy"
                    )
                # The stored arrays themselves (int32 ids, float16 log-probs): pickled as raw bytes for the broadcast,
                # where Python lists cost ~5x the time and twice the bytes (see benchmarks/buffer_memory.py).
                payload.append((key, entry.row, [(t.completion_ids, t.logps) for t in candidates]))
        payload = broadcast_object_list([payload])[0]
        if not payload:
            return None

        # Entropy scoring of every candidate of the questions that have more than one (all ranks, sharded).
        scored = [i for i, (_, _, candidates) in enumerate(payload) if len(candidates) > 1]
        chosen = [0] * len(payload)
        selected_entropies = []
        if scored and cfg.trajectory_selection != "random":
            prompt_ids = self._tokenize_prompts([payload[i][1]["prompt"] for i in scored])[0]
            flat_prompts, flat_completions = [], []
            for j, i in enumerate(scored):
                for ids, _ in payload[i][2]:
                    flat_prompts.append(prompt_ids[j])
                    flat_completions.append(ids)
            entropies = self._exgrpo_score_entropies(flat_prompts, flat_completions)
            sign = -1.0 if cfg.trajectory_selection == "highest_entropy" else 1.0
            start = 0
            for i in scored:
                n = len(payload[i][2])
                scores = entropies[start : start + n]
                best = int(torch.argmin(sign * scores))
                chosen[i] = best
                selected_entropies.append(float(scores[best]))
                start += n

        n_exp = len(payload)
        first = num_groups - n_exp  # the last n_exp groups of the batch are replayed
        return _ReplayPlan(
            group_indices=list(range(first, num_groups)),
            keys=[key for key, _, _ in payload],
            rows=[row for _, row, _ in payload],
            completion_ids=[payload[i][2][chosen[i]][0].tolist() for i in range(n_exp)],
            behaviour_logps=[torch.tensor(payload[i][2][chosen[i]][1], dtype=torch.float32) for i in range(n_exp)],
            num_groups=num_groups,
            selected_entropies=selected_entropies,
        )

    @torch.no_grad()
    def _exgrpo_score_entropies(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> torch.Tensor:
        """Mean per-token entropy of each (prompt, completion) under the current policy, over its completion only.

        The candidates are split evenly over the ranks, each rank padding its share to the same number of rows, so
        every rank runs the same number of forward passes (DeepSpeed ZeRO-3 hangs otherwise); results are gathered.
        """
        total = len(completion_ids)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per_rank = math.ceil(total / world)
        mine = list(range(rank * per_rank, min((rank + 1) * per_rank, total)))
        mine += [mine[-1] if mine else 0] * (per_rank - len(mine))  # padding rows: scored, then discarded
        entropies = self._exgrpo_mean_entropies([prompt_ids[i] for i in mine], [completion_ids[i] for i in mine])
        return self.accelerator.gather(entropies).cpu()[:total]

    @torch.no_grad()
    def _exgrpo_mean_entropies(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> torch.Tensor:
        """Mean completion entropy of each row, in forward passes over rows of similar length.

        Rows are sorted by length and cut into chunks of at most `per_device_train_batch_size` and at most
        SCORING_CHUNK_ROWS rows, each padded only to its own longest row: stored trajectories vary a lot in length,
        and padding every row to the longest one roughly doubled the scoring cost. The number of chunks depends only
        on the number of rows, which is the same on every rank.
        """
        n = len(completion_ids)
        lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
        order = sorted(range(n), key=lengths.__getitem__)
        chunk_rows = max(1, min(self.args.per_device_train_batch_size, SCORING_CHUNK_ROWS))
        means = torch.empty(n, dtype=torch.float32, device=self.accelerator.device)  # stays on the device
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for start in range(0, n, chunk_rows):
                rows = order[start : start + chunk_rows]
                input_ids, attention_mask, completion_mask = pad_prompt_completion(
                    [prompt_ids[i] for i in rows], [completion_ids[i] for i in rows], self._tokenizer.pad_token_id,
                    device=self.accelerator.device,
                )
                _, entropies, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, completion_mask.size(1), batch_size=len(rows),
                    compute_entropy=True,
                )
                means[torch.tensor(rows, device=means.device)] = masked_mean_per_row(entropies.float(), completion_mask)
        return means

    def _exgrpo_apply_plan(self, inputs: list[dict], plan: _ReplayPlan | None) -> tuple[list[dict], list[int]]:
        """Give the K rows of each replayed group to its stored question and reserve the group's first row for the
        stored trajectory. Returns the new inputs and, per local row, the plan index it replays (-1: fresh)."""
        replay_rows = [-1] * len(inputs)
        if plan is None:
            return inputs, replay_rows
        inputs = list(inputs)
        offset = self.accelerator.process_index * len(inputs)
        k = self.num_generations
        splice = {}
        for j, (group, row) in enumerate(zip(plan.group_indices, plan.rows)):
            for global_row in range(group * k, (group + 1) * k):
                local = global_row - offset
                if 0 <= local < len(inputs):
                    inputs[local] = dict(row)
                    if global_row == group * k:
                        replay_rows[local] = j
                        splice[local] = plan.completion_ids[j]
        self._exgrpo_splice = splice
        return inputs, replay_rows

    # ------------------------------------------------------------------------------------------ after scoring
    def _exgrpo_after_scoring(self, inputs, output, plan: _ReplayPlan | None, replay_rows: list[int]) -> None:
        cfg: ExGRPOConfig = self.args
        k_gen = self.num_generations
        device = output["completion_ids"].device
        num_local = len(inputs)
        offset = self.accelerator.process_index * num_local

        # Success of every row of the whole batch, from the rewards TRL gathered across ranks.
        rewards = self._exgrpo_rewards
        weights = self.reward_weights.to(rewards.device)
        total = (rewards * weights.unsqueeze(0)).nansum(dim=1)
        solved = (total >= cfg.success_reward_threshold) & ~torch.isnan(rewards).all(dim=1)  # (N,)
        successes = solved.view(-1, k_gen).sum(dim=1).tolist()  # k per global group
        pass_at_1 = solved.float().mean().item()

        collecting = self.exgrpo_state["replay_active"]  # the state this batch was generated under
        eos_and_pad = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        completion_ids = self._exgrpo_completion_ids
        groups, row_keys = [], {}
        for local in range(num_local):
            global_row = offset + local
            group = global_row // k_gen
            k = successes[group]
            key = question_key(inputs[local]["prompt"])
            if global_row % k_gen == 0 and k > 0:  # the rank holding a group's first row reports the group
                keep_row = collecting and k < k_gen
                groups.append((group, key, k, inputs[local] if keep_row else None))
            if (
                collecting
                and 0 < k < k_gen
                and bool(solved[global_row])
                and replay_rows[local] < 0
                and completion_ids[local]
                and completion_ids[local][-1] in eos_and_pad  # never store a truncated completion
            ):
                row_keys[local] = (global_row, key)
        spg = self.args.steps_per_generation
        self._exgrpo_pending = _PendingCollection(
            groups=groups,
            row_keys=row_keys,
            micro_batches_left=spg - self._step % spg,
            step=self.state.global_step,
        )

        # Per-row keys for the loss: they follow TRL's shuffle and split of the batch.
        output["exgrpo_row"] = torch.arange(num_local, device=device)
        output["exgrpo_collect"] = torch.tensor([i in row_keys for i in range(num_local)], device=device)
        if plan is not None:
            replay_mask = torch.tensor([j >= 0 for j in replay_rows], device=device)
            behaviour = torch.zeros(output["completion_ids"].shape, dtype=torch.float32, device=device)
            for local, j in enumerate(replay_rows):
                if j >= 0:
                    logps = plan.behaviour_logps[j]
                    behaviour[local, : logps.numel()] = logps.to(device)
            output["exgrpo_replay_mask"] = replay_mask
            output["exgrpo_behaviour_logps"] = behaviour

        # Delayed start (SPEC §7): judged on a purely on-policy batch, effective from the next generation batch.
        if not self.exgrpo_state["replay_active"] and pass_at_1 > (cfg.replay_start_pass_rate or 0.0):
            self.exgrpo_state["replay_active"] = True
            logger.info(f"ExGRPO: batch Pass@1 {pass_at_1:.3f} > {cfg.replay_start_pass_rate}: replay starts.")
        self.exgrpo_state["generation_batches"] += 1

        metrics = self._metrics["train"]
        n_exp = len(plan.group_indices) if plan is not None else 0
        metrics[METRIC_PREFIX + "replay/active"].append(float(collecting))
        metrics[METRIC_PREFIX + "replay/fraction"].append(n_exp / max(1, len(successes)))
        metrics[METRIC_PREFIX + "batch/pass_at_1"].append(pass_at_1)
        if plan is not None and plan.selected_entropies:
            mean_entropy = sum(plan.selected_entropies) / len(plan.selected_entropies)
            metrics[METRIC_PREFIX + "replay/selected_entropy"].append(mean_entropy)
        if self.accelerator.is_main_process:
            self._exgrpo_log_buffer_metrics()

    def _exgrpo_log_buffer_metrics(self) -> None:
        buffer, metrics = self.experience_buffer, self._metrics["train"]
        metrics[METRIC_PREFIX + "buffer/questions"].append(float(buffer.num_questions))
        metrics[METRIC_PREFIX + "buffer/trajectories"].append(float(buffer.num_trajectories))
        metrics[METRIC_PREFIX + "buffer/retired"].append(float(len(buffer.retired)))
        for bucket, count in buffer.bucket_counts().items():
            metrics[f"{METRIC_PREFIX}buffer/bucket_{bucket}"].append(float(count))

    def _exgrpo_flush(self, keep_pending: bool = False) -> None:
        """Commit the pending batch outcome to the buffer. A collective: every rank calls it at the same point.

        With `keep_pending` (a checkpoint in the middle of a generation batch's first pass) the trajectories
        recorded so far are committed and the rest follow when the pass ends; group updates are idempotent, so
        applying them twice changes nothing.
        """
        pending = self._exgrpo_pending
        if pending is None:
            return
        if not keep_pending:
            self._exgrpo_pending = None
        trajectories = [
            (pending.row_keys[local][0], pending.row_keys[local][1], ids, logps)
            for local, (ids, logps) in pending.trajectories.items()
        ]
        pending.trajectories = {}
        gathered = gather_object([(pending.groups, trajectories)])
        groups = sorted(g for rank_groups, _ in gathered for g in rank_groups)
        by_key: dict[str, list[Trajectory]] = {}
        if self.accelerator.is_main_process:
            for global_row, key, ids, logps in sorted(t for _, rank_trajs in gathered for t in rank_trajs):
                by_key.setdefault(key, []).append(Trajectory(ids, logps, pending.step))
        for _, key, k, row in groups:
            if self.accelerator.is_main_process:
                self.experience_buffer.update_group(key, k, row, by_key.pop(key, ()))
            elif k == self.num_generations:  # other ranks keep only the retired set (for the sampler)
                self.experience_buffer.retire(key)

    # ------------------------------------------------------------------------------------------ checkpoints
    def _exgrpo_trainer_state(self) -> dict[str, Any]:
        passes = self._exgrpo_sampler.passes if self._exgrpo_sampler is not None else []
        return {**self.exgrpo_state, "sampler_passes": [sorted(p) for p in passes]}

    def _save_checkpoint(self, model, trial):
        # Written into the checkpoint folder BEFORE super() saves the rest and may start the Hub upload of it.
        self._exgrpo_flush(keep_pending=True)
        if self.args.should_save:
            checkpoint = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            save_state(checkpoint, self.experience_buffer, self._exgrpo_trainer_state())
        super()._save_checkpoint(model, trial)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        path = os.path.join(self.args.output_dir, "README.md")
        if not self.is_world_process_zero() or not os.path.isfile(path):
            return
        section = exgrpo_card_section(
            self.args, self.experience_buffer, self.state.global_step, self.exgrpo_state["replay_active"]
        )
        with open(path, encoding="utf-8") as f:
            card = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(add_section(card, section))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)  # under DeepSpeed it returns early; we still run
        if checkpoint is None:
            return
        if not has_state(checkpoint):
            logger.warning(
                f"ExGRPO: {checkpoint} holds no ExGRPO state (a plain GRPO checkpoint?): training resumes with an "
                "empty experience buffer and the delayed-start switch from the config."
            )
            return
        # Only the main process holds trajectories; the others need the retired set (for the sampler).
        saved = load_state(checkpoint, self.experience_buffer, with_trajectories=self.accelerator.is_main_process)
        self.exgrpo_state.update({k: v for k, v in saved.items() if k != "sampler_passes"})
        if self._exgrpo_sampler is not None:
            self._exgrpo_sampler.resume_passes = [frozenset(p) for p in saved.get("sampler_passes", [])]

    # ------------------------------------------------------------------------------------------ loss
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        if self._exgrpo_capture:
            self._exgrpo_captured_logps = logps
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        training = self.model.training
        replay = training and "exgrpo_replay_mask" in inputs
        pending = self._exgrpo_pending
        collect = training and pending is not None and pending.micro_batches_left > 0 and "exgrpo_row" in inputs
        if not (replay or collect):
            return super()._compute_loss(model, inputs)

        inputs_for_trl = inputs
        if replay:
            replay_mask = inputs["exgrpo_replay_mask"]  # (B,)
            # Replayed rows add nothing to TRL's fresh-token loss but still count in its normaliser.
            inputs_for_trl = {**inputs, "advantages": inputs["advantages"].masked_fill(replay_mask, 0.0)}
        self._exgrpo_capture = True
        try:
            loss = super()._compute_loss(model, inputs_for_trl)
            per_token_logps = self._exgrpo_captured_logps  # (B, T), with grad
        finally:
            self._exgrpo_capture, self._exgrpo_captured_logps = False, None

        if collect:
            self._exgrpo_record_behaviour_logps(inputs, per_token_logps)
        if replay:
            loss = loss + self._exgrpo_replay_loss(inputs, per_token_logps)
        return loss

    def _exgrpo_record_behaviour_logps(self, inputs, per_token_logps: torch.Tensor) -> None:
        pending = self._exgrpo_pending
        behaviour = inputs.get("old_per_token_logps")
        behaviour = per_token_logps.detach() if behaviour is None else behaviour  # (B, T)
        rows = inputs["exgrpo_row"].tolist()
        for position in inputs["exgrpo_collect"].nonzero().flatten().tolist():
            length = int(inputs["completion_mask"][position].sum())
            ids = inputs["completion_ids"][position, :length].tolist()
            pending.trajectories[rows[position]] = (ids, behaviour[position, :length].float().cpu().tolist())
        pending.micro_batches_left -= 1
        if pending.micro_batches_left == 0:
            self._exgrpo_flush()

    def _exgrpo_replay_loss(self, inputs, per_token_logps: torch.Tensor) -> torch.Tensor:
        cfg: ExGRPOConfig = self.args
        replay_mask = inputs["exgrpo_replay_mask"].unsqueeze(1)  # (B, 1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1)
        per_token_loss, w, shaped = shaped_replay_token_loss(
            per_token_logps,
            inputs["exgrpo_behaviour_logps"],
            advantages,
            gamma=cfg.policy_shaping_gamma,
            importance_correction=cfg.replay_importance_correction,
        )
        per_token_loss = per_token_loss * replay_mask  # (B, T): fresh rows are TRL's
        replay_loss = aggregate_token_loss(
            per_token_loss,
            mask,
            loss_type=self.loss_type,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            gradient_accumulation_steps=self.current_gradient_accumulation_steps,
            steps_per_generation=self.args.steps_per_generation,
            training=True,
        )
        # Statistics over replayed tokens of all ranks: one collective per micro-batch, on every rank.
        token_mask = (mask * replay_mask).bool()  # (B, T)
        local = torch.stack(
            [
                w[token_mask].sum(),
                shaped[token_mask].sum(),
                token_mask.sum().to(w.dtype),
                w[token_mask].max() if token_mask.any() else w.new_tensor(0.0),
                replay_loss.detach(),
            ]
        ).float()
        stats = self.accelerator.gather(local.unsqueeze(0))  # (world, 5)
        count = stats[:, 2].sum().item()
        metrics = self._metrics["train"]
        if count > 0:
            metrics[METRIC_PREFIX + "replay/is_weight_mean"].append(stats[:, 0].sum().item() / count)
            metrics[METRIC_PREFIX + "replay/is_weight_max"].append(stats[:, 3].max().item())
            metrics[METRIC_PREFIX + "replay/shaped_weight_mean"].append(stats[:, 1].sum().item() / count)
        metrics[METRIC_PREFIX + "replay/loss"].append(stats[:, 4].mean().item())
        return replay_loss
