"""`ExGRPOTrainer`: TRL's GRPOTrainer with ExGRPO's experience replay (arXiv 2510.02245)."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import os
import textwrap
import warnings
from typing import Any

import numpy as np
import torch
from accelerate.utils import broadcast_object_list, gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer
from trl.data_utils import prepare_multimodal_messages
from trl.models.utils import disable_gradient_checkpointing

from .buffer import row_images
from .card import add_section, exgrpo_card_section, fix_local_references
from .checkpoints import remove_state_leftovers, rotate_checkpoints
from .checks import check_arguments, check_built
from .export import tokenizer_fingerprint
from .replay import merge_spliced, splice_rollout
from .run import METRIC_PREFIX, BatchKey, ExGRPORun, GenerationBatch, Ranks
from .scoring import masked_mean_per_row, model_token_mask, pad_prompt_completion

__all__ = [
    "METRIC_PREFIX", "REPLAYED_COLUMN", "BatchKey", "ExGRPOTrainer", "GenerationBatch", "finish_pending_push",
    "save_without_push",
]  # fmt: skip

logger = logging.get_logger(__name__)

# Rows per entropy-scoring forward pass (see `_exgrpo_mean_entropies`). Scoring 94 stored trajectories on the
# benchmark's CPU model took 62.8 ms in chunks of 16, 55.6 ms in chunks of 32 and 60.0 ms in chunks of 48.
SCORING_CHUNK_ROWS = 32
REPLAYED_COLUMN = "exgrpo_replayed"  # column of the completions table marking replayed rows


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


def _from_run(name: str, doc: str) -> property:
    """A trainer attribute that is the run's `name` (read and set)."""
    return property(
        lambda self: getattr(self.exgrpo_run, name), lambda self, v: setattr(self.exgrpo_run, name, v), doc=doc
    )


@contextlib.contextmanager
def _own_key_names(model):
    """Within the block, `model.save_pretrained` writes the model's own weight names. transformers saves a model that
    has a checkpoint conversion mapping (Qwen2-VL, LLaVA and other vision-language models) under its original names,
    but resumes a checkpoint with a plain `load_state_dict`, which then matches no weight and trains on from the base
    model's (transformers#43701): a checkpoint must hold the names it is resumed with. For other models the two are
    the same and nothing changes."""
    save = type(model).save_pretrained
    if "save_original_format" not in inspect.signature(save).parameters:  # a PEFT model or an older transformers
        yield
        return
    model.save_pretrained = functools.partial(save, model, save_original_format=False)
    try:
        yield
    finally:
        del model.save_pretrained


def save_without_push(trainer, output_dir: str) -> None:
    """`trainer.save_model(output_dir)` that never pushes by itself (with `push_to_hub` set, Trainer.save_model would
    also push, as a first commit), as Trainer.push_to_hub saves; a collective under ZeRO-3. Any Trainer."""
    trainer.save_model(output_dir, _internal_call=True)


def finish_pending_push(trainer) -> None:
    """Wait for a checkpoint upload still in flight (it would race with a commit made now). Any Trainer."""
    trainer._finish_current_push()


class ExGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that learns from its own past successes (ExGRPO, arXiv 2510.02245).

    Successful rollouts go into an :class:`~exgrpo_trl.ExperienceBuffer`; every generation batch, `replay_ratio` of
    its questions are drawn from the buffer (favouring medium difficulty), each with its lowest-entropy stored
    trajectory, which joins K-1 fresh rollouts of the same question in one GRPO group; replayed tokens are weighted by
    f(w) = w / (w + gamma), unclipped. With `replay_ratio=0` training is exactly GRPOTrainer's. The constructor is
    GRPOTrainer's; `args` must be an :class:`~exgrpo_trl.ExGRPOConfig`. ExGRPO's state and the steps of a generation
    batch are an :class:`~exgrpo_trl.run.ExGRPORun` (`exgrpo_run`), free of TRL; the checks at init are in `checks`.
    This class only translates TRL's hooks into calls on the run, each override calling `super()`, and is the one
    module of the package that names a private attribute or method of TRL or transformers:

    ===================================== ========================================== ===============================
    hook                                  TRL calls it to                            the run's step (``ExGRPORun``)
    ===================================== ========================================== ===============================
    ``__init__``                          build the trainer                          argument checks first, then the
                                                                                     run (``seed_buffer`` from an
                                                                                     export)
    ``_get_train_sampler``                draw each epoch's questions                ``wrap_sampler``: retired ones
                                                                                     skipped, its place saved
    ``_generate_and_score_completions``   make and score one generation batch        ``begin_batch`` (plan, scored by
                                                                                     ``_exgrpo_score_candidates`` on
                                                                                     every rank; rows), then
                                                                                     ``after_scoring``
    ``_generate_single_turn``             sample completions                         stored trajectories spliced
                                                                                     into their rows (first turn)
    ``_tool_call_loop``                   run tool calls turn by turn                stored rows kept out of the
                                                                                     loop, their masks and messages
    ``_generate``                         call a user's ``rollout_func``             its output gets the stored rows
    ``_calculate_rewards``                score every row                            ``scored``: what the reward
                                                                                     functions saw; stored
                                                                                     environment rewards
    ``_compute_loss``                     the loss of one micro-batch                ``record_behaviour``, and
                                                                                     ``replay_term`` added
    ``_get_per_token_logps_and_entropies`` the policy's forward pass                 its log-probs kept for the term
    ``_save_checkpoint``                  write a checkpoint                         ``flush`` and ``save`` first;
                                                                                     our own rotation
    ``_load_optimizer_and_scheduler``     restore a checkpoint                       ``restore``
    ``_issue_warnings_after_load``        report keys a checkpoint lacks             tied weights are not "missing"
    ``_run_epoch``                        train one epoch                            nothing past ``max_steps``;
                                                                                     the sampler told the epoch
    ``create_model_card``                 write the model card                       an ExGRPO section
    ``log``                               write one log row                          ``fill_log``: every ExGRPO
                                                                                     metric on every training row
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

    _exgrpo_captured: list[torch.Tensor] | None = None  # open while `_exgrpo_capture_logps` is
    experience_buffer = _from_run("buffer", "The run's :class:`~exgrpo_trl.ExperienceBuffer`.")
    exgrpo_state = _from_run("switches", "ExGRPO's switches: replay active, generation batches so far.")
    last_replay_plan = _from_run("last_plan", "The last training generation batch's plan (None: nothing replayed).")
    replay_token_weights = _from_run(
        "replay_token_weights", "Set to a list to receive the importance weights of replayed tokens per loss pass."
    )

    @property
    def offline_guide(self):
        """The run's offline guide, None without offline guidance."""
        return self.exgrpo_run.offline if self.exgrpo_run.offline.active else None

    @property
    def last_offline_rows(self) -> int:
        """Offline rows (every rank's) in the last training generation batch; never generated."""
        return self.exgrpo_run.offline.last_rows

    def __init__(self, *args, **kwargs):
        params = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments
        check_arguments(params)  # errors before TRL loads anything; puts in an ExGRPOConfig when args is None
        params.pop("self")
        reward_funcs = params.get("reward_funcs")
        num_user_rewards = 0 if reward_funcs is None else len(reward_funcs) if isinstance(reward_funcs, list) else 1
        super().__init__(**params)
        for warning in check_built(self.args, self.loss_type):
            logger.warning(warning)
        acc = self.accelerator
        self.exgrpo_run = ExGRPORun(
            self.args,
            num_generations=self.num_generations,
            max_completion_length=self.max_completion_length,
            loss_type=self.loss_type,
            tokenize_completion=self._exgrpo_tokenize_completion,
            stop_ids={*self.eos_token_ids, self._tokenizer.pad_token_id},
            reward_names=self.reward_func_names,
            # the reward columns TRL adds for environments that own their reward (`get_reward`), after the user's
            env_reward_columns=range(num_user_rewards, len(self.reward_funcs)),
            keeps_messages=bool(self.tools),
            ranks=Ranks(
                acc.process_index,
                acc.num_processes,
                acc.is_main_process,
                lambda obj: broadcast_object_list([obj])[0],
                gather_object,
                acc.gather,
            ),  # fmt: skip
            metrics=self._metrics["train"],
            warn=logger.warning,
            info=logger.info,
        )
        if self.args.initial_experience is not None:
            self.exgrpo_run.seed_buffer(
                self.args.initial_experience,
                fingerprint=tokenizer_fingerprint(self._tokenizer),
                progress=not self.args.disable_tqdm,
            )

    def _exgrpo_tokenize_completion(self, text: str) -> list[int]:
        """Token ids of `text` as the model's completion of its prompt would be: the text, then EOS."""
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"]) + [self._tokenizer.eos_token_id]

    # ------------------------------------------------------------------------------------------ data
    def _get_train_sampler(self, dataset=None):
        # Always wrapped, so that where the sampler is in its epochs is saved with checkpoints (a resume in a later
        # epoch draws that epoch's order); with nothing to skip it yields exactly TRL's sampler's indices.
        dataset = self.train_dataset if dataset is None else dataset
        return self.exgrpo_run.wrap_sampler(super()._get_train_sampler(dataset), dataset)

    # ------------------------------------------------------------------------------------------ generation
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation never replays and never collects
            with quiet_checkpointing_deprecation():
                return super()._generate_and_score_completions(inputs)
        run = self.exgrpo_run
        batch = run.begin_batch(inputs, score=self._exgrpo_score_candidates)
        self._pending_extra_logs[REPLAYED_COLUMN].extend(batch.rows.is_replayed(i) for i in range(len(inputs)))
        try:
            # copies: TRL adds a rollout function's fields to the rows it is given, and the buffer keeps the dataset's
            with quiet_checkpointing_deprecation():
                output = super()._generate_and_score_completions([dict(x) for x in batch.rows.inputs])
        finally:
            run.batch = None
        spg = self.args.steps_per_generation
        run.after_scoring(
            batch,
            output,
            reward_weights=self.reward_weights,
            micro_batches_left=spg - self._step % spg,
            step=self.state.global_step,
        )
        return output

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        batch = self.exgrpo_run.batch  # None outside a training generation batch
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
        if not splice:
            return completion_ids, logprobs
        return merge_spliced(len(prompt_ids), rows, completion_ids, logprobs, splice)

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        # Where a whole multi-turn completion becomes known: the stored trajectory (spliced whole at the first turn)
        # is kept out of the loop, so none of its tool calls runs again, and gets its model mask and message list.
        batch = self.exgrpo_run.batch
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
        batch: GenerationBatch | None = self.exgrpo_run.batch
        rollout_func = self.rollout_func
        if batch is None or rollout_func is None or not batch.rows.splice:
            return super()._generate(prompts)

        def spliced(prompts, trainer):
            return splice_rollout(rollout_func(prompts, trainer), batch.rows, batch.plan)

        with swapped(self, rollout_func=spliced):
            return super()._generate(prompts)

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
        batch = self.exgrpo_run.batch
        if batch is not None:
            self.exgrpo_run.scored(batch, inputs, prompts, completions, completion_ids_list, rewards_per_func)
        return rewards_per_func

    # ------------------------------------------------------------------------------------------ entropy scoring
    def _exgrpo_score_candidates(self, rows, prompts, completion_ids, masks) -> torch.Tensor:
        """The run's scorer: each stored candidate's mean entropy under the current policy, its prompt tokenized as
        TRL renders it for generation (with the tools of its row's environment). The candidates of one question share
        its row and prompt objects: each is tokenized once (for a VLM that is the processor over its images)."""
        unique: dict[tuple[int, int], int] = {}  # (row, prompt) identity -> its place among the distinct ones
        which, firsts = [], []  # per candidate: its distinct prompt; per distinct prompt: its first candidate
        for i, key in enumerate((id(r), id(p)) for r, p in zip(rows, prompts, strict=True)):
            if key not in unique:
                unique[key] = len(firsts)
                firsts.append(i)
            which.append(unique[key])
        rows, prompts = [rows[i] for i in firsts], [prompts[i] for i in firsts]
        vision = None
        if self._is_vlm:  # each candidate with its question's images, as the training forward sees them
            prompts = vision = [prepare_multimodal_messages(p, row_images(r) or None) for r, p in zip(rows, prompts)]
        if self.environment_factories is None:
            prompt_ids = self._tokenize_prompts(prompts)[0]
        else:  # TRL sets `_batch_environments` per generation batch, before generating; here, for these rows
            environments = [row.get("environment") if self._multi_environment else None for row in rows]
            with swapped(self, _batch_environments=environments):
                prompt_ids = self._tokenize_prompts(prompts)[0]
        prompt_ids = [prompt_ids[u] for u in which]
        if vision is None:
            return self._exgrpo_score_entropies(prompt_ids, completion_ids, masks)
        return self._exgrpo_score_entropies(prompt_ids, completion_ids, masks, vision=[vision[u] for u in which])

    @torch.no_grad()
    def _exgrpo_score_entropies(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        masks: list | None = None,
        vision: list | None = None,
    ) -> torch.Tensor:
        """Mean per-token entropy of each (prompt, completion) under the current policy, over the model's tokens of
        its completion only (`masks`: per row, 1 for the model's tokens; None: all of them). `vision`: for a
        vision-language model, each row's prompt as messages holding its images (None: text only).

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
            [prompt_ids[i] for i in mine],
            [completion_ids[i] for i in mine],
            [masks[i] for i in mine],
            None if vision is None else [vision[i] for i in mine],
        )
        return self.accelerator.gather(entropies).cpu()[:total]

    @torch.no_grad()
    def _exgrpo_mean_entropies(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        masks: list | None = None,
        vision: list | None = None,
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
                images = {} if vision is None else self._exgrpo_vision_inputs([vision[i] for i in rows], input_ids)
                _, entropies, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    completion_mask.size(1),
                    batch_size=len(rows),
                    compute_entropy=True,
                    **images,
                )
                model_tokens = completion_mask * model_token_mask([masks[i] for i in rows], completion_mask)  # (B, C)
                means[torch.tensor(rows, device=means.device)] = masked_mean_per_row(entropies.float(), model_tokens)
        return means

    def _exgrpo_vision_inputs(self, prompts: list, input_ids: torch.Tensor) -> dict[str, Any]:
        """The image inputs of one scoring chunk, as `_get_per_token_logps_and_entropies` takes them for a training
        forward: the processor's fields for these prompts (`_tokenize_prompts`: pixel values, image grids, ...), the
        images per row, and the per-token fields (token type ids) left-padded like the prompts and 0 over the
        completion. `input_ids`: the chunk's (B, P + C) tokens from `pad_prompt_completion`."""
        prompt_ids, images, fields = self._tokenize_prompts(prompts)
        if images is None:  # no row of the chunk has an image
            return {}
        width, device = input_ids.size(1), input_ids.device
        out: dict[str, Any] = {"num_images": [len(row) if row else 0 for row in images]}
        width_prompt = max(len(ids) for ids in prompt_ids)
        for name, value in fields.items():  # as TRL's generation takes them
            if isinstance(value, list) and value and isinstance(value[0], list):  # per token of each prompt
                padded = torch.zeros((len(value), width), dtype=torch.long, device=device)
                for i, row in enumerate(value):
                    padded[i, width_prompt - len(row) : width_prompt] = torch.as_tensor(row, dtype=torch.long)
                out[name] = padded
            else:  # pixel values, image grids, ...: a tensor, or arrays to stack into one
                out[name] = (value if isinstance(value, torch.Tensor) else torch.tensor(np.array(value))).to(device)
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every training log row carries every ExGRPO metric (`ExGRPORun.fill_log`).
        if self.model.training and "loss" in logs:
            self.exgrpo_run.fill_log()
        super().log(logs, start_time)

    # ------------------------------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial):
        # Written into the checkpoint folder BEFORE super() saves the rest and may start the Hub upload of it.
        self.exgrpo_run.flush(keep_pending=True)
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            remove_state_leftovers(run_dir)  # temporary state folders of processes killed while saving
            self.exgrpo_run.save(checkpoint)
        # Rotation is ours (below): transformers orders checkpoints by folder time, and a checkpoint half-deleted by
        # a crash during rotation has the freshest time, so it was kept while complete ones were deleted.
        limit = self.args.save_total_limit
        with swapped(self.args, save_total_limit=None), _own_key_names(self.model):
            super()._save_checkpoint(model, trial)
        # Every rank writes files of its own (its RNG state; under DeepSpeed its partitions), and nothing in
        # super() waits for them: rotating before they are all written could delete the older complete checkpoints
        # while the new one is still incomplete (with save_total_limit 1, all of them). Every rank saves, so every
        # rank reaches this barrier (a no-op on one process).
        self.accelerator.wait_for_everyone()
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
        # The sampler is told the epoch here, not through the dataloader: resumed inside an epoch on several
        # processes, accelerate's skip_first_batches wraps the batch sampler once more (SkipBatchSampler around
        # BatchSamplerShard around the BatchSampler), and neither accelerate's set_epoch nor transformers' reaches
        # that deep; the sampler then counted from epoch 0 and dropped the saved passes of the epoch it resumed in.
        if self.exgrpo_run.sampler is not None:
            epoch = inspect.signature(super()._run_epoch).bind(*args, **kwargs).arguments["epoch"]
            self.exgrpo_run.sampler.set_epoch(epoch)
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
        if checkpoint is not None:
            self.exgrpo_run.restore(checkpoint)

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
        collect_now = training and self.exgrpo_run.collects_in(inputs)
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
            self.exgrpo_run.record_behaviour(inputs, per_token_logps)
        if replay:
            steps = self.current_gradient_accumulation_steps
            loss = loss + self.exgrpo_run.replay_term(inputs, per_token_logps, gradient_accumulation_steps=steps)
        return loss
