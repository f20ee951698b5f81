"""`ExGRPOTrainer`: TRL's GRPOTrainer with ExGRPO's experience replay (arXiv 2510.02245)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import textwrap
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer
from trl.data_utils import prepare_multimodal_messages
from trl.models.utils import disable_gradient_checkpointing

from .buffer import row_images
from .card import add_section, exgrpo_card_section, fix_local_references, fix_quick_start
from .checkpoints import find_resumable_checkpoint, remove_state_leftovers, rotate_checkpoints
from .checks import check_arguments, check_built
from .compat import own_key_names, plain_cpu_map_location, quiet_checkpointing_deprecation, swapped
from .export import tokenizer_fingerprint
from .replay import merge_spliced, splice_rollout
from .run import BatchKey, ExGRPORun, GenerationBatch, Rollouts
from .scoring import EntropyScorer, image_inputs
from .training_state import METRIC_PREFIX, ExGRPOState, Messages, Ranks
from .vllm_server import guard_client

__all__ = [
    "METRIC_PREFIX", "REPLAYED_COLUMN", "BatchKey", "ExGRPOTrainer", "GenerationBatch", "finish_pending_push",
    "save_without_push",
]  # fmt: skip

logger = logging.get_logger(__name__)

# Rows per entropy-scoring forward pass (`scoring.EntropyScorer`). Scoring 94 stored trajectories on the
# benchmark's CPU model took 62.8 ms in chunks of 16, 55.6 ms in chunks of 32 and 60.0 ms in chunks of 48.
SCORING_CHUNK_ROWS = 32
REPLAYED_COLUMN = "exgrpo_replayed"  # column of the completions table marking replayed rows
GENERATED_ROWS = (
    "ExGRPO: the generation backend {what} for {asked} prompt rows ({skipped} of this batch's {rows} rows hold a "
    "stored trajectory and are not sampled: a replayed group generates K - 1 rows); a generate that returns a fixed "
    "number of rows, such as a test's mock, cannot serve replay: return one completion per prompt row it is given"
)


def _server_hint(output_dir: str) -> str:
    """What to do once the vLLM server is gone: start it again, then run on from the newest complete checkpoint."""
    checkpoint, _ = find_resumable_checkpoint(output_dir)
    where = f"the newest complete checkpoint, {checkpoint}" if checkpoint else "step 0 (no complete checkpoint yet)"
    return f"start the server again, then run the same command (`exgrpo train` resumes from {where})"


def save_without_push(trainer, output_dir: str) -> None:
    """`trainer.save_model(output_dir)` that never pushes by itself (with `push_to_hub` set, Trainer.save_model would
    also push, as a first commit), as Trainer.push_to_hub saves; a collective under ZeRO-3. Any Trainer."""
    trainer.save_model(output_dir, _internal_call=True)


def finish_pending_push(trainer) -> None:
    """Wait for a checkpoint upload still in flight (it would race with a commit made now). Any Trainer."""
    trainer._finish_current_push()


class ExGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that learns from its own past successes (ExGRPO, arXiv 2510.02245).

    Successful rollouts go into an :class:`~exgrpo_trl.ExperienceBuffer`; every generation batch, a share of its
    questions (the replay ratio) are drawn from the buffer (favouring medium difficulty), each with its lowest-entropy
    stored trajectory, which joins K-1 fresh rollouts of the same question in one GRPO group; replayed tokens are
    weighted by f(w) = w / (w + gamma), unclipped. With a replay ratio of 0 training is exactly GRPOTrainer's. The
    constructor is GRPOTrainer's; `args` must be an :class:`~exgrpo_trl.ExGRPOConfig`.

    ExGRPO's training state (the buffer, the clock, the delayed start, the sampler's place: what a checkpoint holds)
    is `exgrpo_state`, an :class:`~exgrpo_trl.training_state.ExGRPOState`; the steps of one generation batch are
    `exgrpo_run`, an :class:`~exgrpo_trl.run.ExGRPORun` on that state (its `last_plan`: the last training generation
    batch's replay plan; its `replay_token_weights`, set to a list, receives the importance weights of replayed
    tokens). Both are free of TRL; the checks at init are in `checks`, the entropy scorer in `scoring`. This class
    only translates TRL's hooks into calls on them, each override calling `super()`, and is the one module of the
    package that names a private attribute or method of TRL or transformers. The hooks (what TRL calls each for):

    - ``__init__`` (build the trainer): argument checks first, then the state (seeded from an export) and the run;
    - ``_get_train_sampler`` (draw each epoch's questions): ``state.wrap_sampler``, retired ones skipped, its place
      saved;
    - ``_generate_and_score_completions`` (make and score one generation batch): ``run.generation_batch`` (the plan,
      its candidates scored by ``_exgrpo_score_candidates`` on every rank; the rows), then ``run.finish``;
    - ``_generate_single_turn`` (sample completions): stored trajectories spliced into their rows (first turn);
    - ``_tool_call_loop`` (run tool calls turn by turn): stored rows kept out of the loop, their masks and messages;
    - ``_generate`` (call a user's ``rollout_func``): its output gets the stored rows;
    - ``_calculate_rewards`` (score every row): ``run.scored``, what the reward functions saw; stored environment
      rewards put back;
    - ``_compute_loss`` (the loss of one micro-batch): ``run.record_behaviour``, and ``run.replay_term`` added;
    - ``_get_per_token_logps_and_entropies`` (the policy's forward pass): its log-probs kept for the term;
    - ``_save_checkpoint`` (write a checkpoint): ``run.flush`` and ``state.save`` first; our own rotation;
    - ``_load_optimizer_and_scheduler`` (restore a checkpoint): ``state.restore``;
    - ``_issue_warnings_after_load`` (report keys a checkpoint lacks): tied weights are not "missing";
    - ``_run_epoch`` (train one epoch): nothing past ``max_steps``; the sampler told the epoch;
    - ``create_model_card`` (write the model card): an ExGRPO section;
    - ``log`` (write one log row): ``state.log_metrics``, every ExGRPO metric on every training row.

    The order these fire in over one generation batch, and what each does, is on the trainer page ("How it works
    inside TRL").
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
    # Built by __init__; None on a trainer made without it (TRL's own unit tests build bare ones with object.__new__),
    # which then behaves as GRPOTrainer.
    exgrpo_state: ExGRPOState | None = None
    exgrpo_run: ExGRPORun | None = None

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
        ranks = Ranks(
            acc.process_index,
            acc.num_processes,
            acc.is_main_process,
            lambda obj: broadcast_object_list([obj])[0],
            gather_object,
            acc.gather,
        )  # fmt: skip
        self.exgrpo_state = ExGRPOState(
            self.args,
            self.num_generations,
            tokenize=self._exgrpo_tokenize_completion,
            max_completion_length=self.max_completion_length,
            ranks=ranks,
            messages=Messages(logger.warning, logger.info),
            seed=self.args.seed,
        )
        rollouts = Rollouts(
            tokenize=self._exgrpo_tokenize_completion,
            max_completion_length=self.max_completion_length,
            stop_ids=frozenset({*self.eos_token_ids, self._tokenizer.pad_token_id}),
            loss_type=self.loss_type,
            reward_names=tuple(self.reward_func_names),
            # the reward columns TRL adds for environments that own their reward (`get_reward`), after the user's
            env_reward_columns=tuple(range(num_user_rewards, len(self.reward_funcs))),
            keeps_messages=bool(self.tools),
            steps_per_generation=self.args.steps_per_generation,
        )
        self.exgrpo_run = ExGRPORun(self.exgrpo_state, rollouts, self._metrics["train"])
        client = getattr(getattr(self, "vllm_generation", None), "vllm_client", None)  # server mode, main process
        if self.use_vllm and self.vllm_mode == "server" and client is not None:
            output_dir = self.args.output_dir
            guard_client(client, self.args.vllm_server_request_timeout, lambda: _server_hint(output_dir))
        self.exgrpo_state.seed_buffer(
            fingerprint=tokenizer_fingerprint(self._tokenizer),
            tokenize=self._exgrpo_tokenize_completion,
            max_length=self.max_completion_length,
            progress=not self.args.disable_tqdm,
        )

    def _exgrpo_open_batch(self) -> GenerationBatch | None:
        """The training generation batch being generated and scored; None outside one, and without ExGRPO's run."""
        return None if self.exgrpo_run is None else self.exgrpo_run.open_batch

    def _exgrpo_tokenize_completion(self, text: str) -> list[int]:
        """Token ids of `text` as the model's completion of its prompt would be: the text, then EOS."""
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"]) + [self._tokenizer.eos_token_id]

    # ------------------------------------------------------------------------------------------ data
    def _get_train_sampler(self, dataset=None):
        # Always wrapped, so that where the sampler is in its epochs is saved with checkpoints (a resume in a later
        # epoch draws that epoch's order); with nothing to skip it yields exactly TRL's sampler's indices.
        dataset = self.train_dataset if dataset is None else dataset
        if self.exgrpo_state is None:
            return super()._get_train_sampler(dataset)
        return self.exgrpo_state.wrap_sampler(super()._get_train_sampler(dataset), dataset)

    # ------------------------------------------------------------------------------------------ generation
    def _generate_and_score_completions(self, inputs):
        if not self.model.training or self.exgrpo_run is None:  # evaluation never replays and never collects
            with quiet_checkpointing_deprecation():
                return super()._generate_and_score_completions(inputs)
        run = self.exgrpo_run
        with run.generation_batch(inputs, score=self._exgrpo_score_candidates) as batch:
            self._pending_extra_logs[REPLAYED_COLUMN].extend(batch.rows.is_replayed(i) for i in range(len(inputs)))
            # copies: TRL adds a rollout function's fields to the rows it is given, and the buffer keeps the dataset's
            with quiet_checkpointing_deprecation():
                output = super()._generate_and_score_completions([dict(x) for x in batch.rows.inputs])
            left = self.args.steps_per_generation - self._step % self.args.steps_per_generation  # first-pass passes
            output.update(run.finish(batch, output, reward_weights=self.reward_weights, micro_batches_left=left))
        return output

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        batch = self._exgrpo_open_batch()
        # Only the first call holds every row: the tool loop calls again for the rows that called a tool, and with a
        # rollout function the rows are the function's (spliced in `_generate`).
        first_turn = batch is not None and batch.next_turn() and self.rollout_func is None
        splice = batch.rows.splice if first_turn else {}
        rows = list(range(len(prompt_ids)))
        if self._exgrpo_can_skip_spliced_rows(splice, prompt_ids, images, multimodal_fields):
            rows = [i for i in rows if i not in splice]  # do not sample a completion only to discard it
        skipped = len(prompt_ids) - len(rows)
        try:
            completion_ids, logprobs = super()._generate_single_turn(
                [prompt_ids[i] for i in rows], images, multimodal_fields, num_generations, has_tool_images
            )
        except RuntimeError as error:  # a size mismatch inside a generate that ignores how many rows it was given
            if not skipped or isinstance(error, torch.OutOfMemoryError):
                raise
            what = f"failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
            raise RuntimeError(
                GENERATED_ROWS.format(what=what, asked=len(rows), skipped=skipped, rows=len(prompt_ids))
            ) from error
        if len(completion_ids) != len(rows):
            what = f"returned {len(completion_ids)} completions"
            raise RuntimeError(
                GENERATED_ROWS.format(what=what, asked=len(rows), skipped=skipped, rows=len(prompt_ids))
            )
        if not splice:
            return completion_ids, logprobs
        return merge_spliced(len(prompt_ids), rows, completion_ids, logprobs, splice)

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        # Where a whole multi-turn completion becomes known: the stored trajectory (spliced whole at the first turn)
        # is kept out of the loop, so none of its tool calls runs again, and gets its model mask and message list.
        batch = self._exgrpo_open_batch()
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
        batch = self._exgrpo_open_batch()
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
        batch = self._exgrpo_open_batch()
        if batch is None:
            return rewards_per_func
        return self.exgrpo_run.scored(batch, inputs, prompts, completions, completion_ids_list, rewards_per_func)

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

    def _exgrpo_entropy_scorer(self) -> EntropyScorer:
        """`scoring.EntropyScorer` over TRL's forward pass, sharded over this run's processes."""

        def forward(input_ids, attention_mask, logits_to_keep, batch_size, **images):
            _, entropies, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, compute_entropy=True,
                **images,
            )  # fmt: skip
            return entropies

        acc = self.accelerator
        return EntropyScorer(
            forward,
            self._tokenizer.pad_token_id,
            max(1, min(self.args.per_device_train_batch_size, SCORING_CHUNK_ROWS)),
            acc.device,
            acc.process_index,
            acc.num_processes,
            acc.gather,
            self._exgrpo_vision_inputs,
        )

    @torch.no_grad()
    def _exgrpo_score_entropies(self, prompt_ids, completion_ids, masks=None, vision=None) -> torch.Tensor:
        """Mean per-token entropy of each (prompt, completion) under the current policy, over the model's tokens of
        its completion only, the same on every rank (`scoring.EntropyScorer`: every rank runs the same number of
        forward passes). `vision`: for a vision-language model, each row's prompt as messages holding its images."""
        with (
            quiet_checkpointing_deprecation(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            return self._exgrpo_entropy_scorer()(prompt_ids, completion_ids, masks, vision)

    def _exgrpo_vision_inputs(self, prompts: list, input_ids: torch.Tensor) -> dict[str, Any]:
        """The image inputs of one scoring chunk (`scoring.image_inputs`) from the processor's output for its prompts
        (`_tokenize_prompts`: prompt ids, images per row, pixel values, image grids, ...)."""
        return image_inputs(*self._tokenize_prompts(prompts), input_ids)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Every training log row carries every ExGRPO metric (`ExGRPOState.log_metrics`).
        if self.exgrpo_state is not None and self.model.training and "loss" in logs:
            self.exgrpo_state.log_metrics(self._metrics["train"])
        super().log(logs, start_time)

    # ------------------------------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial):
        if self.exgrpo_state is None:
            return super()._save_checkpoint(model, trial)
        # Written into the checkpoint folder BEFORE super() saves the rest and may start the Hub upload of it.
        self.exgrpo_run.flush(keep_pending=True)
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            remove_state_leftovers(run_dir)  # temporary state folders of processes killed while saving
            self.exgrpo_state.save(checkpoint)
        # Rotation is ours (below): transformers orders checkpoints by folder time, and a checkpoint half-deleted by
        # a crash during rotation has the freshest time, so it was kept while complete ones were deleted.
        limit = self.args.save_total_limit
        with swapped(self.args, save_total_limit=None), own_key_names(self.model):
            super()._save_checkpoint(model, trial)
        # Every rank writes files of its own (its RNG state, DeepSpeed's partitions) and super() waits for none of
        # them: rotating before they are all written could delete the older complete checkpoints.
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
        # Told here, not through the dataloader: resumed inside an epoch on several processes, accelerate wraps the
        # batch sampler once more, and neither its set_epoch nor transformers' reaches the sampler any longer.
        if self.exgrpo_state is not None:
            self.exgrpo_state.set_epoch(inspect.signature(super()._run_epoch).bind(*args, **kwargs).arguments["epoch"])
        return super()._run_epoch(*args, **kwargs)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        # A local dataset is not a Hub dataset: TRL would link it (and list it in the card's metadata) as one.
        local_dataset = dataset_name if dataset_name and os.path.exists(dataset_name) else None
        super().create_model_card(
            model_name=model_name, dataset_name=None if local_dataset else dataset_name, tags=tags
        )
        path = os.path.join(self.args.output_dir, "README.md")
        if not self.is_world_process_zero() or not os.path.isfile(path) or self.exgrpo_state is None:
            return
        section = exgrpo_card_section(self.args, self.exgrpo_state, self.state.global_step)
        with open(path, encoding="utf-8") as f:
            card = f.read()
        card = fix_local_references(
            card,
            base_model=getattr(getattr(self.model, "config", None), "_name_or_path", None) or None,
            local_dataset=local_dataset,
            output_dir=self.args.output_dir,
        )
        dataset = self.train_dataset  # its first prompt in the usage snippet (an iterable dataset has no first row)
        if "prompt" in (getattr(dataset, "column_names", None) or []) and hasattr(dataset, "__len__") and len(dataset):
            card = fix_quick_start(card, dataset[0]["prompt"], self.max_completion_length)
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
        with plain_cpu_map_location():  # transformers 5.17 on several CPU processes (compat.plain_cpu_map_location)
            super()._load_optimizer_and_scheduler(checkpoint)  # under DeepSpeed it returns early; we still run
        if checkpoint is not None and self.exgrpo_state is not None:
            args = self.args  # optimizer updates per generation batch: for states stamped with the optimizer step
            updates = args.steps_per_generation * args.num_iterations / args.gradient_accumulation_steps
            self.exgrpo_state.restore(checkpoint, updates_per_batch=updates)

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
        loss types give -r * A on fresh tokens (rows the run marked `BatchKey.UNCLIPPED`); its clip metrics then read
        0."""
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
        training = self.model.training and self.exgrpo_run is not None
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
