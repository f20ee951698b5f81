"""`ExGRPOTrainer`: TRL's GRPOTrainer with ExGRPO's experience replay (arXiv 2510.02245)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import os
import textwrap
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from accelerate.utils import broadcast_object_list, gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from .buffer import ExperienceBuffer, question_key
from .card import add_section, exgrpo_card_section, fix_local_references
from .checkpoints import remove_state_leftovers, restore_state, rotate_checkpoints
from .checks import check_arguments, check_built, threshold_mismatch
from .config import ExGRPOConfig
from .export import read_export_meta, seed_buffer, tokenizer_fingerprint
from .loss import ReplayTokenStats, aggregate_token_loss, shaped_replay_token_loss
from .offline import OfflineGuide, offline_rows, offline_verdicts
from .replay import (
    BatchOutcome,
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
)
from .sampler import SkipRetiredSampler
from .scoring import masked_mean_per_row, model_token_mask, pad_prompt_completion
from .state import save_state

logger = logging.get_logger(__name__)

METRIC_PREFIX = "exgrpo/"
# Rows per entropy-scoring forward pass (see `_exgrpo_mean_entropies`). Scoring 94 stored trajectories on the
# benchmark's CPU model took 62.8 ms in chunks of 16, 55.6 ms in chunks of 32 and 60.0 ms in chunks of 48.
SCORING_CHUNK_ROWS = 32
REPLAYED_COLUMN = "exgrpo_replayed"  # column of the completions table marking replayed rows


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
    """What one training generation batch hands from hook to hook. Created in `_generate_and_score_completions`
    before it calls `super()`, filled by the hooks TRL calls from there, and dropped when it returns."""

    plan: ReplayPlan | None  # what is replayed (the same on every rank)
    rows: RowAssignment  # this rank's rows: which carry a replayed question, which a stored trajectory
    turns: int = 0  # `_generate_single_turn` calls so far: the first is the first turn of every row
    # What TRL handed the reward functions (`_calculate_rewards`), this rank's rows, replayed ones included:
    completion_ids: list[list[int]] | None = None  # whole (multi-turn) completions
    prompts: list[Any] | None = None  # the prompts, as an environment's reset() may have completed them
    completions: list[Any] | None = None  # decoded completions (with a tool loop: its message lists)
    fields: list[dict[str, Any]] | None = None  # per row, the columns a rollout function added to the dataset row
    rewards: torch.Tensor | None = None  # (N_global, F): every rank's rewards, gathered


@contextlib.contextmanager
def quiet_checkpointing_deprecation():
    """TRL 1.16's generation and `disable_gradient_checkpointing` call the model's `is_gradient_checkpointing`,
    `gradient_checkpointing_disable` and `_enable`, which transformers 5 deprecates: FutureWarnings about TRL's code
    (not the user's) at every generation and entropy-scoring pass, whether checkpointing is on or off."""
    with warnings.catch_warnings():
        deprecated = r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"
        warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)
        yield


@contextlib.contextmanager
def swapped(obj, **values):
    """Within the block, `obj`'s attributes hold `values` (where TRL reads them from); restored afterwards."""
    saved = {name: getattr(obj, name, None) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def _plain(value):
    """JSON fallback for what reward functions see: numpy and torch values as plain numbers and lists."""
    if isinstance(value, (np.generic, np.ndarray, torch.Tensor)):
        return value.tolist()
    raise TypeError(f"a value of type {type(value).__name__}")


class ExGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that learns from its own past successes (ExGRPO, arXiv 2510.02245).

    Successful rollouts go into an :class:`~exgrpo_trl.ExperienceBuffer`; every generation batch, `replay_ratio` of
    its questions are drawn from the buffer (favouring medium difficulty), each with its lowest-entropy stored
    trajectory, which joins K-1 fresh rollouts of the same question in one GRPO group; replayed tokens are weighted by
    f(w) = w / (w + gamma), unclipped. With `replay_ratio=0` training is exactly GRPOTrainer's. The constructor is
    GRPOTrainer's; `args` must be an :class:`~exgrpo_trl.ExGRPOConfig`. The bookkeeping is in `replay` (drawing, rows,
    outcomes, collection) and `sampler`, free of the training loop; the checks at init in `checks`; checkpoint state
    in `checkpoints` and `state`. This class wires them into TRL's hooks, each override calling `super()`:

    ===================================== ========================================== ===============================
    hook                                  TRL calls it to                            ExGRPO adds
    ===================================== ========================================== ===============================
    ``__init__``                          build the trainer                          argument checks first, then the
                                                                                     buffer and its switches (seeded
                                                                                     from an export), offline guide
    ``_get_train_sampler``                draw each epoch's questions                retired questions skipped; the
                                                                                     sampler's place saved
    ``_generate_and_score_completions``   make and score one generation batch        the replay plan (drawn, scored
                                                                                     for entropy on every rank), row
                                                                                     assignment, then outcomes, the
                                                                                     collection and per-row keys
    ``_generate_single_turn``             sample completions                         the stored trajectory spliced
                                                                                     into each replayed group's row
    ``_tool_call_loop``                   run tool calls turn by turn                stored rows kept out of the
                                                                                     loop, their masks and messages
    ``_generate``                         call a user's ``rollout_func``             its output gets the stored rows
    ``_calculate_rewards``                score every row                            keeps what the reward functions
                                                                                     saw; stored environment rewards
    ``_compute_loss``                     the loss of one micro-batch                the shaped replayed-token term;
                                                                                     behaviour log-probs recorded
    ``_get_per_token_logps_and_entropies`` the policy's forward pass                 its log-probs kept for the term
    ``_save_checkpoint``                  write a checkpoint                         the buffer saved first; our own
                                                                                     rotation
    ``_load_optimizer_and_scheduler``     restore a checkpoint                       the buffer and switches restored
    ``_issue_warnings_after_load``        report keys a checkpoint lacks             tied weights are not "missing"
    ``_run_epoch``                        train one epoch                            nothing past ``max_steps``
    ``create_model_card``                 write the model card                       an ExGRPO section
    ``log``                               write one log row                          every ExGRPO metric on every
                                                                                     training row; counts as gauges
    ===================================== ========================================== ===============================

    The order these fire in over one generation batch, and what each does, is on the trainer page ("How it works
    inside TRL"). `last_replay_plan` holds the plan of the last training generation batch (None when nothing was
    replayed); `replay_token_weights`, set to a list, receives the importance weights of replayed tokens.
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
                author       = {Runzhe Zhan and Yafu Li and Zhi Wang and Xiaoye Qu and Dongrui Liu and Jing Shao and
                                Derek F. Wong and Yu Cheng},
                year         = 2025,
                eprint       = {arXiv:2510.02245},
            }"""),
    }

    def __init__(self, *args, **kwargs):
        params = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments
        check_arguments(params)  # errors before TRL loads anything; puts in an ExGRPOConfig when args is None
        params.pop("self")
        reward_funcs = params.get("reward_funcs")
        num_user_rewards = 0 if reward_funcs is None else len(reward_funcs) if isinstance(reward_funcs, list) else 1
        super().__init__(**params)
        cfg: ExGRPOConfig = self.args
        for warning in check_built(cfg, self.loss_type, self._is_vlm):
            logger.warning(warning)
        # The reward columns TRL adds for environments that own their reward (`get_reward`), after the user's own.
        self._exgrpo_env_reward_columns = list(range(num_user_rewards, len(self.reward_funcs)))
        self.experience_buffer = ExperienceBuffer(
            self.num_generations,
            mu=cfg.replay_mu,
            sigma=cfg.replay_sigma,
            question_selection=cfg.question_selection,
            seed=cfg.seed,
            cooldown=cfg.replay_cooldown,
        )
        # Offline guidance (`offline.py`): reference solutions as each fresh group's first row; None when off.
        self.offline_guide: OfflineGuide | None = None
        if cfg.offline_solutions_column is not None:
            self.offline_guide = OfflineGuide(
                cfg.offline_solutions_column,
                cfg.offline_guidance,
                self.max_completion_length,
                self._exgrpo_tokenize_completion,
            )
        # Training state beside the buffer (persisted with checkpoints).
        self.exgrpo_state = {"replay_active": not cfg.replay_start_pass_rate, "generation_batches": 0}
        self._exgrpo_batch: GenerationBatch | None = None  # the generation batch being scored
        self._exgrpo_pending: PendingCollection | None = None  # its outcome, until committed to the buffer
        self._exgrpo_captured: list[torch.Tensor] | None = None  # open while `_exgrpo_capture_logps` is
        self._exgrpo_sampler: SkipRetiredSampler | None = None
        self._exgrpo_threshold_warned = False  # `_exgrpo_check_threshold` speaks once per run
        self._exgrpo_record_warned = False  # `_exgrpo_row_record` speaks once per run
        self._exgrpo_offline_warned = False  # the too-long offline solutions, once per run
        # The plan of the last training generation batch (None: nothing replayed), for callbacks and studies.
        self.last_replay_plan: ReplayPlan | None = None
        # Offline rows (every rank's) in the last training generation batch; never generated (offline guidance).
        self.last_offline_rows = 0
        # Set it to a list to receive, per loss pass, the importance weights w of this rank's replayed tokens (1-D,
        # detached, on the CPU): the distribution behind the logged means, for diagnostics. None: nothing is kept.
        self.replay_token_weights: list[torch.Tensor] | None = None
        self._exgrpo_latest: dict[str, float] = {}  # the latest generation batch's metrics (`log`)
        self._exgrpo_seed_buffer()

    def _exgrpo_tokenize_completion(self, text: str) -> list[int]:
        """Token ids of `text` as the model's completion of its prompt would be: the text, then EOS."""
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"]) + [self._tokenizer.eos_token_id]

    def _exgrpo_seed_buffer(self) -> None:
        """`initial_experience`: fill the buffer from an `exgrpo export` (`export.seed_buffer`). Every rank checks
        the export's num_generations (one small file read, no collective); only the main process, which holds the
        trajectories, reads the rows: the other ranks need the retired set only, and an export carries none. A resume
        replaces the seeded buffer with the checkpoint's (`_load_optimizer_and_scheduler`)."""
        path = self.args.initial_experience
        if path is None:
            return
        meta = read_export_meta(path, num_generations=self.num_generations)
        if not self.accelerator.is_main_process:
            return
        report = seed_buffer(
            self.experience_buffer,
            path,
            fingerprint=tokenizer_fingerprint(self._tokenizer),
            tokenize=self._exgrpo_tokenize_completion,
            max_length=self.max_completion_length,
            meta=meta,
            progress=not self.args.disable_tqdm,
        )
        skipped = report.skipped()
        if skipped:
            logger.warning(f"ExGRPO: initial_experience {path}: left out {skipped}.")
        how = (
            "tokenized again with this run's tokenizer (the export's differs), as offline trajectories"
            if report.retokenized
            else "with their token ids and behaviour log-probs"
        )
        logger.info(
            f"ExGRPO: seeded the experience buffer from {path}: {report.questions} questions, "
            f"{report.trajectories} trajectories, {how}."
        )

    # ------------------------------------------------------------------------------------------ data
    def _get_train_sampler(self, dataset=None):
        # Always wrapped, so that where the sampler is in its epochs is saved with checkpoints (a resume in a later
        # epoch draws that epoch's order); with nothing to skip it yields exactly TRL's sampler's indices.
        sampler = super()._get_train_sampler(dataset)
        skip = self.args.skips_retired
        dataset = self.train_dataset if dataset is None else dataset
        retired = self.experience_buffer.retired if skip else set()
        sampler = SkipRetiredSampler(sampler, lambda: dataset["prompt"], retired)
        previous = getattr(self, "_exgrpo_sampler", None)
        if previous is not None and previous.resume is not None:  # the dataloader was rebuilt after a resume
            sampler.resume = previous.resume
        self._exgrpo_sampler = sampler
        return sampler

    # ------------------------------------------------------------------------------------------ generation
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation never replays and never collects
            with quiet_checkpointing_deprecation():
                return super()._generate_and_score_completions(inputs)

        self._exgrpo_flush()  # normally already done after the first loss pass; a no-op then
        plan = self.last_replay_plan = self._exgrpo_make_plan(len(inputs))
        rows = self._exgrpo_apply_plan(inputs, plan)
        if self.offline_guide is not None:
            self._exgrpo_add_offline_rows(rows, plan)
        self._pending_extra_logs[REPLAYED_COLUMN].extend(rows.is_replayed(i) for i in range(len(inputs)))
        batch = self._exgrpo_batch = GenerationBatch(plan, rows)
        try:
            # copies: TRL adds a rollout function's fields to the rows it is given, and the buffer keeps the dataset's
            with quiet_checkpointing_deprecation():
                output = super()._generate_and_score_completions([dict(x) for x in rows.inputs])
        finally:
            self._exgrpo_batch = None
        self._exgrpo_after_scoring(batch, output)
        return output

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        batch = self._exgrpo_batch  # None outside a training generation batch
        # Only the first call holds every row: the tool loop calls again for the rows that called a tool, and with a
        # rollout function the rows are the function's (spliced in `_generate`).
        first_turn = batch is not None and batch.turns == 0 and self.rollout_func is None
        splice = batch.rows.splice if first_turn else {}
        if batch is not None:
            batch.turns += 1
        rows = list(range(len(prompt_ids)))
        if self._exgrpo_can_skip_spliced_rows(splice, prompt_ids, images, multimodal_fields):
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
        return completion_ids, logprobs

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        # Where a whole multi-turn completion becomes known: the stored trajectory (spliced whole at the first turn)
        # is kept out of the loop, so none of its tool calls runs again, and gets its model mask and message list.
        batch = self._exgrpo_batch
        splice = batch.rows.splice if batch is not None else {}
        parsed = {row: completions[row] for row in splice}
        for row in splice:
            completions[row] = [{"role": "assistant", "content": ""}]  # no tool call: the loop leaves the row alone
        tool_mask, completions, completion_ids, logprobs, *rest = super()._tool_call_loop(
            prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
        )
        for row in splice:
            j = batch.rows.replay_rows[row]
            tool_mask[row] = batch.plan.mask(j)
            completions[row] = copy.deepcopy(batch.plan.record(j).get("completion", parsed[row]))
        return (tool_mask, completions, completion_ids, logprobs, *rest)

    def _generate(self, prompts):
        # A rollout function produces every row; its output gets the stored trajectories before TRL decodes it.
        batch = self._exgrpo_batch
        rollout_func = self.rollout_func
        if batch is None or rollout_func is None or not batch.rows.splice:
            return super()._generate(prompts)

        def spliced(prompts, trainer):
            return self._exgrpo_splice_rollout(rollout_func(prompts, trainer), batch)

        with swapped(self, rollout_func=spliced):
            return super()._generate(prompts)

    def _exgrpo_splice_rollout(self, output: dict[str, Any], batch: GenerationBatch) -> dict[str, Any]:
        """A rollout function's output with each reserved row replaced by its stored trajectory: token ids, model
        mask (`env_mask`, created for every row if the function returned none), the per-row fields the function
        returned for it when it was stored, and unknown sampling log-probs (NaN: vLLM's correction leaves it at 1)."""
        plan, n = batch.plan, len(output["completion_ids"])
        output = {key: list(value) if isinstance(value, list) else value for key, value in output.items()}
        completion_ids, logprobs = output["completion_ids"], output["logprobs"]
        if output.get("env_mask") is None and any(m is not None for m in plan.masks):
            output["env_mask"] = [[1] * len(ids) for ids in completion_ids]
        for row in batch.rows.splice:
            j = batch.rows.replay_rows[row]
            completion_ids[row] = list(plan.completion_ids[j])
            if logprobs is not None:
                logprobs[row] = [None] * len(completion_ids[row])
            if output.get("env_mask") is not None:
                output["env_mask"][row] = plan.mask(j)
            for key, value in plan.record(j).get("fields", {}).items():
                if isinstance(output.get(key), list) and len(output[key]) == n:
                    output[key][row] = copy.deepcopy(value)
        return output

    def _exgrpo_can_skip_spliced_rows(self, splice, prompt_ids, images, multimodal_fields) -> bool:
        """Whether the rows a stored trajectory takes can be left out of generation.

        Generation backends that take one prompt per row and run no collective tied to the row count can skip them:
        `generate` (under ZeRO-3 it syncs decoding steps, not rows), continuous batching, and colocated vLLM without
        tensor parallelism. vLLM server mode asks the server for exactly K completions of each distinct prompt, and
        colocated tensor parallelism slices equal shares per rank, so there every row is generated and the spliced
        ones discarded. A rank never drops all of its rows.
        """
        if not splice or images is not None or multimodal_fields or len(splice) >= len(prompt_ids):
            return False
        return not (self.use_vllm and (self.vllm_mode != "colocate" or self.vllm_tensor_parallel_size > 1))

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        batch = self._exgrpo_batch
        if batch is not None:
            self._exgrpo_use_stored_env_rewards(batch, rewards_per_func)
            batch.rewards = rewards_per_func
            batch.completion_ids = [list(ids) for ids in completion_ids_list]
            batch.prompts, batch.completions = list(prompts), list(completions)
            batch.fields = [{k: v for k, v in x.items() if k not in row} for x, row in zip(inputs, batch.rows.inputs)]
        return rewards_per_func

    def _exgrpo_use_stored_env_rewards(self, batch: GenerationBatch, rewards: torch.Tensor) -> None:
        """A stored trajectory's tool calls are not run again, so its environment is only reset: an environment-owned
        reward (`get_reward`) of a replayed row is the one its environment gave when the trajectory was stored."""
        plan = batch.plan
        if plan is None or not plan.with_trajectories or not self._exgrpo_env_reward_columns:
            return
        for j, group in enumerate(plan.group_indices):
            stored = plan.record(j).get("rewards", {})
            for column in self._exgrpo_env_reward_columns:
                name = self.reward_func_names[column]
                if name in stored:
                    value = stored[name]
                    rewards[group * self.num_generations, column] = math.nan if value is None else value

    # ------------------------------------------------------------------------------------------ replay plan
    def _exgrpo_make_plan(self, num_local: int) -> ReplayPlan | None:
        """Draw the replayed questions on the main process, broadcast them, and select one trajectory per question:
        the lowest (or highest) mean entropy under the current policy among its candidates (algorithm §5-6)."""
        cfg: ExGRPOConfig = self.args
        num_groups = num_local * self.accelerator.num_processes // self.num_generations
        if not (self.exgrpo_state["replay_active"] and cfg.replays):
            return None
        drawn = None
        if self.accelerator.is_main_process:
            n_exp = replay_count(self.experience_buffer.num_questions, cfg.replay_ratio, num_groups)
            # The stored arrays themselves (int32 ids, float16 log-probs) are pickled as raw bytes for the broadcast,
            # where Python lists cost ~5x the time and twice the bytes (see benchmarks/buffer_memory.py).
            drawn = draw_replay_questions(
                self.experience_buffer,
                n_exp,
                trajectory_selection=cfg.trajectory_selection,
                max_candidates=cfg.max_trajectory_candidates,
            )
        drawn = broadcast_object_list([drawn])[0]
        if not drawn:
            return None

        # Entropy scoring of every candidate of the questions that have more than one (all ranks, sharded).
        scored = [i for i, question in enumerate(drawn) if len(question.candidates) > 1]
        chosen = [0] * len(drawn)
        selected_entropies = []
        if scored and cfg.trajectory_selection != "random" and cfg.replay_stored_trajectory:
            # each candidate under the prompt it was sampled with (an environment's reset() may have completed it)
            candidates = [(drawn[i].row, c) for i in scored for c in drawn[i].candidates]
            flat_prompts = self._exgrpo_tokenize_prompts(
                [row for row, _ in candidates],
                [(c.record or {}).get("prompt", row["prompt"]) for row, c in candidates],
            )
            flat_completions = [c.completion_ids for _, c in candidates]
            masks = [c.mask for _, c in candidates]  # None: every token is the model's (single-turn)
            entropies = self._exgrpo_score_entropies(flat_prompts, flat_completions, masks)
            start = 0
            for i in scored:
                scores = entropies[start : start + len(drawn[i].candidates)]
                chosen[i] = select_lowest(scores, highest=cfg.trajectory_selection == "highest_entropy")
                selected_entropies.append(float(scores[chosen[i]]))
                start += len(drawn[i].candidates)
        return ReplayPlan.build(drawn, chosen, num_groups, selected_entropies, cfg.replay_stored_trajectory)

    def _exgrpo_tokenize_prompts(self, rows: list[dict[str, Any]], prompts: list[Any]) -> list[list[int]]:
        """Token ids of `prompts` as TRL renders them for generation (with the tools of each row's environment)."""
        if self.environment_factories is None:
            return self._tokenize_prompts(prompts)[0]
        # TRL sets `_batch_environments` per generation batch, before generating; here, for these rows
        environments = [row.get("environment") if self._multi_environment else None for row in rows]
        with swapped(self, _batch_environments=environments):
            return self._tokenize_prompts(prompts)[0]

    @torch.no_grad()
    def _exgrpo_score_entropies(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], masks: list | None = None
    ) -> torch.Tensor:
        """Mean per-token entropy of each (prompt, completion) under the current policy, over the model's tokens of
        its completion only (`masks`: per row, 1 for the model's tokens; None: all of them).

        The candidates are split evenly over the ranks, each rank padding its share to the same number of rows, so
        every rank runs the same number of forward passes (DeepSpeed ZeRO-3 hangs otherwise); results are gathered.
        """
        total = len(completion_ids)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per_rank = math.ceil(total / world)
        mine = list(range(rank * per_rank, min((rank + 1) * per_rank, total)))
        mine += [mine[-1] if mine else 0] * (per_rank - len(mine))  # padding rows: scored, then discarded
        masks = [None] * total if masks is None else masks
        entropies = self._exgrpo_mean_entropies(
            [prompt_ids[i] for i in mine], [completion_ids[i] for i in mine], [masks[i] for i in mine]
        )
        return self.accelerator.gather(entropies).cpu()[:total]

    @torch.no_grad()
    def _exgrpo_mean_entropies(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], masks: list | None = None
    ) -> torch.Tensor:
        """Mean entropy of each row over its completion's model tokens (`masks`, None: all of them), in forward
        passes over rows of similar length.

        Rows are sorted by length and cut into chunks of at most `per_device_train_batch_size` and at most
        SCORING_CHUNK_ROWS rows, each padded only to its own longest row: stored trajectories vary a lot in length,
        and padding every row to the longest one roughly doubled the scoring cost. The number of chunks depends only
        on the number of rows, which is the same on every rank.
        """
        n = len(completion_ids)
        masks = [None] * n if masks is None else masks
        lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
        order = sorted(range(n), key=lengths.__getitem__)
        chunk_rows = max(1, min(self.args.per_device_train_batch_size, SCORING_CHUNK_ROWS))
        means = torch.empty(n, dtype=torch.float32, device=self.accelerator.device)  # stays on the device
        with (
            quiet_checkpointing_deprecation(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            for start in range(0, n, chunk_rows):
                rows = order[start : start + chunk_rows]
                input_ids, attention_mask, completion_mask = pad_prompt_completion(
                    [prompt_ids[i] for i in rows],
                    [completion_ids[i] for i in rows],
                    self._tokenizer.pad_token_id,
                    device=self.accelerator.device,
                )
                _, entropies, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    completion_mask.size(1),
                    batch_size=len(rows),
                    compute_entropy=True,
                )
                model_tokens = completion_mask * model_token_mask([masks[i] for i in rows], completion_mask)  # (B, C)
                means[torch.tensor(rows, device=means.device)] = masked_mean_per_row(entropies.float(), model_tokens)
        return means

    def _exgrpo_apply_plan(self, inputs: list[dict], plan: ReplayPlan | None) -> RowAssignment:
        """This rank's rows with the plan applied (`replay.assign_rows`)."""
        return assign_rows(inputs, plan, process_index=self.accelerator.process_index, k=self.num_generations)

    def _exgrpo_add_offline_rows(self, rows: RowAssignment, plan: ReplayPlan | None) -> None:
        """Give each fresh group's first row held here its question's offline solution (`offline.offline_rows`): it
        is spliced in place of a generated completion, as a replayed group's stored trajectory is."""
        keys = [question_key(x["prompt"]) for x in rows.inputs]
        chosen = offline_rows(
            rows.inputs,
            self.offline_guide,
            keys,
            replayed_groups=plan.group_indices if plan is not None else (),
            process_index=self.accelerator.process_index,
            k=self.num_generations,
            retired=self.experience_buffer.retired,
        )
        for local, (row, ids) in chosen.items():
            rows.splice[local] = ids
            rows.offline[local] = row

    def _exgrpo_score_offline_rows(self, batch: GenerationBatch, outcome: BatchOutcome, output: dict) -> None:
        """After the reward functions have scored the batch: every rank learns every offline row's verdict (one
        collective), a solution scored unsolved is rejected for good and its row gets advantage 0 (no gradient; it
        leaves the replayed-token term), and the batch's Pass@1 (the delayed start's) counts generated rows only."""
        guide = self.offline_guide
        solved = outcome.solved.tolist()  # one copy to the host, not one per row
        local_rows = [(row.key, row.index, row.global_row) for row in batch.rows.offline.values()]
        everything = [row for rank_rows in gather_object([local_rows]) for row in rank_rows]
        verdicts = offline_verdicts(everything, solved)
        guide.rejected.update(verdicts.unsolved)
        self.last_offline_rows = len(everything)
        for local, row in list(batch.rows.offline.items()):
            if not solved[row.global_row]:
                output["advantages"][local] = 0.0
                del batch.rows.offline[local]
        outcome.pass_at_1 = verdicts.pass_at_1
        self._exgrpo_batch_figures(
            {
                "offline/groups": len(everything) / max(1, len(outcome.successes)),
                "offline/unsolved": len(verdicts.unsolved),
            }
        )
        self._exgrpo_latest["offline/rejected"] = float(len(guide.rejected))  # a count: its value, never a mean
        if guide.too_long and not self._exgrpo_offline_warned:
            logger.warning(
                f"ExGRPO: {len(guide.too_long)} offline solution(s) are longer than max_completion_length "
                f"({self.max_completion_length} tokens) once tokenized and are not used"
            )
            self._exgrpo_offline_warned = True

    # ------------------------------------------------------------------------------------------ after scoring
    def _exgrpo_after_scoring(self, batch: GenerationBatch, output: dict[str, Any]) -> None:
        """Everything that follows TRL's scoring of one generation batch (step 4 of the class docstring)."""
        cfg: ExGRPOConfig = self.args
        outcome = batch_outcome(batch.rewards, self.reward_weights, cfg.success_reward_threshold, self.num_generations)
        self._exgrpo_check_threshold(batch.rewards, outcome)
        if self.offline_guide is not None:
            self._exgrpo_score_offline_rows(batch, outcome, output)
        collecting = self.exgrpo_state["replay_active"]  # the state this batch was generated under
        spg = self.args.steps_per_generation
        tool_mask = output.get("tool_mask")  # (B, T): 0 where a tool or an environment inserted the token
        masks = None
        if tool_mask is not None:
            masks = [tool_mask[i, : len(ids)].tolist() for i, ids in enumerate(batch.completion_ids)]
        self._exgrpo_pending = collect(
            batch.rows,
            outcome,
            batch.completion_ids,
            process_index=self.accelerator.process_index,
            k=self.num_generations,
            collecting=collecting,
            stop_ids={*self.eos_token_ids, self._tokenizer.pad_token_id},
            micro_batches_left=spg - self._step % spg,
            step=self.state.global_step,
            masks=masks,
        )
        for local in list(self._exgrpo_pending.rows):
            try:
                self._exgrpo_pending.rows[local].record = self._exgrpo_row_record(batch, local)
            except (TypeError, ValueError) as e:  # what the reward functions saw of it cannot be saved: not stored
                del self._exgrpo_pending.rows[local]
                if not self._exgrpo_record_warned:
                    logger.warning(
                        f"ExGRPO: a successful rollout is not stored: what its reward functions saw is not JSON ({e})"
                    )
                    self._exgrpo_record_warned = True
        self._exgrpo_add_row_keys(output, batch, self._exgrpo_pending)
        # generated after replay started (never with replay_ratio 0): no clip on fresh tokens
        if cfg.remove_clip_after_replay_start and collecting and cfg.replays:
            output[BatchKey.UNCLIPPED] = torch.ones(
                len(batch.rows.inputs), dtype=torch.bool, device=outcome.solved.device
            )
        self._exgrpo_check_delayed_start(outcome)
        self._exgrpo_log_batch_metrics(batch, outcome, collecting)

    def _exgrpo_row_record(self, batch: GenerationBatch, local: int) -> dict[str, Any] | None:
        """What the reward functions were given for this rank's row `local` beyond its token ids, for a replay to
        give them again without running a tool or an environment (`Trajectory.record`): the message list of a tool
        loop, environment-owned rewards, a rollout function's per-row fields, the prompt as an environment's reset()
        completed it. None when there is nothing of the kind (single-turn training); TypeError or ValueError when it
        is not JSON."""
        record: dict[str, Any] = {}
        if self.tools:
            record["completion"] = batch.completions[local]
        if self._exgrpo_env_reward_columns:
            row = self.accelerator.process_index * len(batch.rows.inputs) + local
            values = [batch.rewards[row, c].item() for c in self._exgrpo_env_reward_columns]
            names = [self.reward_func_names[c] for c in self._exgrpo_env_reward_columns]
            record["rewards"] = {name: None if math.isnan(v) else v for name, v in zip(names, values)}
        if batch.fields[local]:
            record["fields"] = batch.fields[local]
        if batch.prompts[local] != batch.rows.inputs[local].get("prompt"):
            record["prompt"] = batch.prompts[local]
        if not record:
            return None
        return json.loads(json.dumps(record, allow_nan=False, default=_plain))  # a deep copy, as state.json saves it

    def _exgrpo_check_threshold(self, rewards: torch.Tensor, outcome: BatchOutcome) -> None:
        """Warn once per run when the success threshold does not separate this batch's rollouts (`threshold_mismatch`).
        Every rank holds the same gathered rewards; the main process speaks."""
        if self._exgrpo_threshold_warned or not self.accelerator.is_main_process:
            return
        message = threshold_mismatch(
            rewards, self.reward_weights, outcome.solved, self.args.success_reward_threshold, self.num_generations
        )
        if message is not None:
            logger.warning(message)
            self._exgrpo_threshold_warned = True

    def _exgrpo_add_row_keys(self, output: dict[str, Any], batch: GenerationBatch, pending: PendingCollection) -> None:
        """Per-row keys for the loss; TRL's shuffle and split of the batch carry them along with every row."""
        device = output["completion_ids"].device
        num_local = len(batch.rows.inputs)
        output[BatchKey.ROW] = torch.arange(num_local, device=device)
        output[BatchKey.COLLECT] = torch.tensor([i in pending.rows for i in range(num_local)], device=device)
        # With offline guidance on, every batch of every rank carries the keys (the term's statistics are a
        # collective), offline rows with behaviour log-prob 0.
        if (batch.plan is not None and batch.plan.with_trajectories) or self.offline_guide is not None:
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

    def _exgrpo_check_delayed_start(self, outcome: BatchOutcome) -> None:
        """Algorithm §7: judged on a purely on-policy batch, effective from the next generation batch; stays on."""
        threshold = self.args.replay_start_pass_rate or 0.0
        if not self.exgrpo_state["replay_active"] and outcome.pass_at_1 > threshold:
            self.exgrpo_state["replay_active"] = True
            logger.info(f"ExGRPO: batch Pass@1 {outcome.pass_at_1:.3f} > {threshold}: replay starts.")
        self.exgrpo_state["generation_batches"] += 1

    def _exgrpo_log_batch_metrics(self, batch: GenerationBatch, outcome: BatchOutcome, collecting: bool) -> None:
        """The generation batch's figures: averaged over the logging window as TRL averages its own, and kept as the
        latest values for the log rows whose window holds no generation batch (`log`)."""
        plan = batch.plan
        n_exp = len(plan.group_indices) if plan is not None else 0
        latest = {"replay/fraction": n_exp / max(1, len(outcome.successes)), "batch/pass_at_1": outcome.pass_at_1}
        fresh = outcome.successes[: len(outcome.successes) - n_exp]  # the replayed groups are the last n_exp
        if fresh:  # fresh groups with no successful row: no gradient, nothing to store
            latest["batch/fresh_all_fail"] = sum(1 for k in fresh if k == 0) / len(fresh)
        if plan is not None:
            latest["replay/repeat_share"] = plan.repeat_share
        if plan is not None and plan.selected_entropies:
            latest["replay/selected_entropy"] = sum(plan.selected_entropies) / len(plan.selected_entropies)
        self._exgrpo_batch_figures(latest)
        self._exgrpo_latest["replay/active"] = float(collecting)  # a switch: its value, never a window mean

    def _exgrpo_batch_figures(self, figures: dict[str, float]) -> None:
        """A generation batch's figures: into TRL's metrics (averaged over the logging window), and kept as the
        latest values for the log rows whose window holds no generation batch (`log`)."""
        for name, value in figures.items():
            self._metrics["train"][METRIC_PREFIX + name].append(float(value))
        self._exgrpo_latest.update({name: float(value) for name, value in figures.items()})

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every training log row carries every ExGRPO metric: counts and switches as their value at this step (the
        # buffer as it is now), the generation batch's figures as the latest batch's when none fell in the window.
        if self.model.training and "loss" in logs:
            metrics = self._metrics["train"]
            for name, value in self._exgrpo_latest.items():
                if not metrics.get(METRIC_PREFIX + name) or name in ("replay/active", "offline/rejected"):
                    metrics[METRIC_PREFIX + name] = [value]
            if self.accelerator.is_main_process:  # only the main process holds the buffer's trajectories
                buffer = self.experience_buffer
                gauges = {"questions": buffer.num_questions, "trajectories": buffer.num_trajectories,
                          "retired": len(buffer.retired)}  # fmt: skip
                gauges.update({f"bucket_{k}": count for k, count in buffer.bucket_counts().items()})
                for name, value in gauges.items():
                    metrics[f"{METRIC_PREFIX}buffer/{name}"] = [float(value)]
        super().log(logs, start_time)

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
        gathered = gather_object([(pending.groups, pending.take_recorded())])
        if self.offline_guide is not None:  # the questions the model has now solved itself (the `unsolved` rule)
            self.offline_guide.self_solved.update(row.key for _, rows in gathered for row in rows)
        commit(
            self.experience_buffer,
            gathered,
            step=pending.step,
            is_main_process=self.accelerator.is_main_process,
            k=self.num_generations,
        )

    # ------------------------------------------------------------------------------------------ checkpoints
    def _exgrpo_trainer_state(self) -> dict[str, Any]:
        state = dict(self.exgrpo_state)
        if self._exgrpo_sampler is not None:
            state["sampler"] = self._exgrpo_sampler.state_dict()
        if self.offline_guide is not None:
            state["offline"] = self.offline_guide.state_dict()
        return state

    def _save_checkpoint(self, model, trial):
        # Written into the checkpoint folder BEFORE super() saves the rest and may start the Hub upload of it.
        self._exgrpo_flush(keep_pending=True)
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            remove_state_leftovers(run_dir)  # temporary state folders of processes killed while saving
            save_state(checkpoint, self.experience_buffer, self._exgrpo_trainer_state())
        # Rotation is ours (below): transformers orders checkpoints by folder time, and a checkpoint half-deleted by
        # a crash during rotation has the freshest time, so it was kept while complete ones were deleted.
        limit = self.args.save_total_limit
        with swapped(self.args, save_total_limit=None):
            super()._save_checkpoint(model, trial)
        if self.args.should_save:
            rotate_checkpoints(
                run_dir,
                limit,
                keep=[checkpoint, *filter(None, [self.state.best_model_checkpoint])],
                need_optimizer=not self.args.save_only_model,
                adaptive_entropy=bool(getattr(self, "use_adaptive_entropy", False)),
            )

    def _run_epoch(self, *args, **kwargs):
        # Resumed at (or past) max_steps: the run is complete. Transformers would still run the resumed epoch and
        # take one more step before checking, so each restart of a finished run trained (and saved) one step more.
        if self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        # A local dataset is not a Hub dataset: TRL would link it (and list it in the card's metadata) as one.
        local_dataset = dataset_name if dataset_name and os.path.exists(dataset_name) else None
        super().create_model_card(
            model_name=model_name, dataset_name=None if local_dataset else dataset_name, tags=tags
        )
        path = os.path.join(self.args.output_dir, "README.md")
        if not self.is_world_process_zero() or not os.path.isfile(path):
            return
        section = exgrpo_card_section(
            self.args, self.experience_buffer, self.state.global_step, self.exgrpo_state["replay_active"]
        )
        with open(path, encoding="utf-8") as f:
            card = f.read()
        card = fix_local_references(
            card,
            base_model=getattr(getattr(self.model, "config", None), "_name_or_path", None) or None,
            local_dataset=local_dataset,
            output_dir=self.args.output_dir,
        )
        with open(path, "w", encoding="utf-8") as f:
            f.write(add_section(card, section))

    def _issue_warnings_after_load(self, load_result):
        # A model with tied embeddings saves one of the tied tensors (safetensors keeps no aliases); transformers then
        # reports the other as missing on every resume (['lm_head.weight']), which reads like damage. Keys that name
        # a tensor another loaded parameter shares are left out; any other missing key is still reported.
        names_of: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            names_of.setdefault(param.data_ptr(), []).append(name)
        tied = {name for names in names_of.values() if len(names) > 1 for name in names}
        missing = [key for key in load_result.missing_keys if key not in tied]
        return super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)  # under DeepSpeed it returns early; we still run
        if checkpoint is None:
            return
        saved = restore_state(
            checkpoint,
            self.experience_buffer,
            num_generations=self.num_generations,
            is_main_process=self.accelerator.is_main_process,
            warn=logger.warning,
        )
        if saved is None:
            return
        self.exgrpo_state.update({k: v for k, v in saved.items() if k not in ("sampler", "sampler_passes", "offline")})
        if self.offline_guide is not None:
            self.offline_guide.load_state_dict(saved.get("offline", {}))
        if self._exgrpo_sampler is not None:
            # checkpoints before the sampler's state was saved hold the current epoch's passes only
            sampler_state = saved.get("sampler") or {"epoch": None, "passes": saved.get("sampler_passes", [])}
            self._exgrpo_sampler.load_state_dict(sampler_state)

    # ------------------------------------------------------------------------------------------ loss
    @contextlib.contextmanager
    def _exgrpo_capture_logps(self):
        """Within the block, the policy log-probs of every `_get_per_token_logps_and_entropies` call are kept (in the
        yielded list), so that the replayed-token term reuses TRL's forward pass instead of running another."""
        self._exgrpo_captured = captured = []
        try:
            yield captured
        finally:
            self._exgrpo_captured = None

    @contextlib.contextmanager
    def _exgrpo_without_clip(self, active: bool):
        """Within the block TRL's clamp(r, 1 - epsilon_low, 1 + epsilon_high) is the identity, so the PPO-clipped
        loss types give -r * A on fresh tokens (`remove_clip_after_replay_start`); its clip metrics then read 0."""
        with swapped(self, epsilon_low=math.inf, epsilon_high=math.inf) if active else contextlib.nullcontext():
            yield

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        if self._exgrpo_captured is not None:
            self._exgrpo_captured.append(logps)
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        training = self.model.training
        replay = training and BatchKey.REPLAY_MASK in inputs
        pending = self._exgrpo_pending
        collect_now = training and pending is not None and pending.micro_batches_left > 0 and BatchKey.ROW in inputs
        unclipped = training and BatchKey.UNCLIPPED in inputs
        if not (replay or collect_now):
            with self._exgrpo_without_clip(unclipped):
                return super()._compute_loss(model, inputs)

        inputs_for_trl = inputs
        if replay:
            replay_mask = inputs[BatchKey.REPLAY_MASK]  # (B,)
            # Replayed rows add nothing to TRL's fresh-token loss but still count in its normaliser.
            inputs_for_trl = {**inputs, "advantages": inputs["advantages"].masked_fill(replay_mask, 0.0)}
        with self._exgrpo_capture_logps() as captured, self._exgrpo_without_clip(unclipped):
            loss = super()._compute_loss(model, inputs_for_trl)
        per_token_logps = captured[-1]  # (B, T), with grad: the policy forward of this loss pass

        if collect_now:
            self._exgrpo_record_behaviour_logps(inputs, per_token_logps)
        if replay:
            loss = loss + self._exgrpo_replay_loss(inputs, per_token_logps)
        return loss

    def _exgrpo_record_behaviour_logps(self, inputs, per_token_logps: torch.Tensor) -> None:
        pending = self._exgrpo_pending
        behaviour = inputs.get("old_per_token_logps")
        behaviour = per_token_logps.detach() if behaviour is None else behaviour  # (B, T)
        rows = inputs[BatchKey.ROW].tolist()
        tool_mask = inputs.get("tool_mask")  # (B, T): 0 where a tool or an environment inserted the token
        for position in inputs[BatchKey.COLLECT].nonzero().flatten().tolist():
            length = int(inputs["completion_mask"][position].sum())
            ids = inputs["completion_ids"][position, :length].tolist()
            mask = None if tool_mask is None else tool_mask[position, :length].tolist()
            stored = pending.rows[rows[position]]
            stored.completion_ids, stored.mask = ids, mask
            stored.logps = behaviour[position, :length].float().cpu().tolist()
        pending.micro_batches_left -= 1
        if pending.micro_batches_left == 0:
            self._exgrpo_flush()

    def _exgrpo_replay_loss(self, inputs, per_token_logps: torch.Tensor) -> torch.Tensor:
        cfg: ExGRPOConfig = self.args
        replay_mask = inputs[BatchKey.REPLAY_MASK].unsqueeze(1)  # (B, 1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1)
        per_token_loss, w, shaped = shaped_replay_token_loss(
            per_token_logps,
            inputs[BatchKey.BEHAVIOUR_LOGPS],
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
        # Statistics over replayed tokens and over offline tokens of all ranks: one collective per micro-batch, on
        # every rank.
        offline_flags = inputs.get(BatchKey.OFFLINE)  # (B,), present with offline guidance on
        offline_mask = (mask * offline_flags.unsqueeze(1)).bool() if offline_flags is not None else None  # (B, T)
        token_mask = (mask * replay_mask).bool()  # (B, T)
        if offline_mask is not None:
            token_mask = token_mask & ~offline_mask
        if self.replay_token_weights is not None:
            self.replay_token_weights.append(w[token_mask].float().cpu())
        gamma = cfg.policy_shaping_gamma
        local = ReplayTokenStats.of(w, shaped, token_mask, offline_mask, replay_loss, gamma)
        # (world, 9), on the host at once, not one copy per figure read
        rows = self.accelerator.gather(local.as_row().unsqueeze(0)).cpu()
        metrics = self._metrics["train"]
        for name, value in ReplayTokenStats.figures(rows, gamma).items():
            metrics[METRIC_PREFIX + name].append(value)
        return replay_loss
