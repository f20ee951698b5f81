"""Resume that holds at any moment: the sampler's place in its epochs is training state, a run resumed at
max_steps trains nothing, rotation keeps the newest complete checkpoints, no temporary state folder survives, and
save_steps inside generation batches are named at init.

The kill test (real `exgrpo train` processes killed at random moments) is in test_resume_after_crash.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer
from exgrpo_trl.buffer import question_key
from exgrpo_trl.checkpoints import checkpoint_problems, rotate_checkpoints
from exgrpo_trl.checks import save_steps_inside_generation_batches
from exgrpo_trl.sampler import SkipRetiredSampler
from exgrpo_trl.state_file import STATE_DIRNAME
from tests.helpers import config_kwargs, make_model, make_trainer, state_of, synthetic_dataset

PROMPTS = [f"q{i}" for i in range(12)]


def _sampler(retired=None, seed=0):
    # TRL's sampler as GRPOTrainer builds it: 12 questions, each repeated twice in a row, 3 questions per batch
    inner = RepeatSampler(PROMPTS, mini_repeat_count=2, batch_size=3, repeat_count=1, shuffle=True, seed=seed)
    return SkipRetiredSampler(inner, lambda: [question_key(q) for q in PROMPTS], set() if retired is None else retired)


def _epoch(sampler, epoch):
    sampler.set_epoch(epoch)
    return list(sampler)


def _roundtrip(state):
    return json.loads(json.dumps(state))  # what a checkpoint's state.json holds


def test_nothing_retired_is_trls_sampler_exactly():
    plain = RepeatSampler(PROMPTS, mini_repeat_count=2, batch_size=3, repeat_count=1, shuffle=True, seed=0)
    wrapped = _sampler()
    for epoch in range(3):
        assert _epoch(wrapped, epoch) == list(plain)


@pytest.mark.parametrize("consumed", [0, 10, 24])  # the start, the middle and the end of epoch 1 (24 indices)
def test_resume_in_a_later_epoch_draws_that_epochs_order(consumed):
    straight = _sampler()
    epochs = [_epoch(straight, e) for e in range(3)]
    assert epochs[1] != epochs[0] and epochs[2] != epochs[1]  # the generator moves on every epoch

    first = _sampler()
    _epoch(first, 0)
    first.set_epoch(1)
    it = iter(first)
    for _ in range(consumed):
        next(it)
    state = _roundtrip(first.state_dict())
    assert state["epoch"] == (0 if consumed == 0 else 1)  # epoch 1 begins at its first index, not at iter()

    resumed = _sampler()
    resumed.load_state_dict(state)
    # a checkpoint inside epoch 1, or at the end of epoch 0: the Trainer resumes in epoch 1 (skipping what was
    # trained); at the end of epoch 1 it resumes straight in epoch 2
    if consumed < 24:
        assert _epoch(resumed, 1) == epochs[1]
    assert _epoch(resumed, 2) == epochs[2]

    # TRL's own sampler, rebuilt by a resumed GRPOTrainer, draws epoch 0's order again (nothing restores it)
    rebuilt = RepeatSampler(PROMPTS, mini_repeat_count=2, batch_size=3, repeat_count=1, shuffle=True, seed=0)
    assert list(rebuilt) == epochs[0] != epochs[1]


def test_resume_replays_passes_begun_under_another_retired_set():
    """Retirement during an epoch: when the questions not retired run out, a new pass begins over those left then.
    Resumed, the saved passes are replayed with the sets they had, not today's retired set."""
    retired = {question_key(p) for p in PROMPTS[:4]}
    straight = _sampler(retired)
    _epoch(straight, 0)
    straight.set_epoch(1)
    it = iter(straight)
    head = [next(it) for _ in range(18)]  # 8 questions left: a pass is 16 indices, so a second pass has begun
    assert len(straight.passes) == 2
    state = _roundtrip(straight.state_dict())
    retired.add(question_key(PROMPTS[5]))  # retired after the checkpoint: the passes begun before do not see it
    tail = list(it)

    resumed = _sampler({question_key(p) for p in PROMPTS[:4]} | {question_key(PROMPTS[5])})
    resumed.load_state_dict(state)
    assert _epoch(resumed, 1) == head + tail
    assert not {0, 1, 2, 3} & set(head + tail)


# 16 questions, 4 a step: an epoch is 4 steps; a checkpoint every step. ExGRPO replays from the first step.
EPOCHS = dict(train_dataset=synthetic_dataset(n=16, always_every=4), save_strategy="steps", save_steps=1)
AT_ONCE = dict(replay_start_pass_rate=0.0)


def _resume(tmp_path, straight_dir, name, step, tokenizer, cls=ExGRPOTrainer, **config):
    out = tmp_path / name
    shutil.copytree(straight_dir / "out" / f"checkpoint-{step}", out / "out" / f"checkpoint-{step}")
    exgrpo = AT_ONCE if issubclass(cls, ExGRPOTrainer) else {}
    trainer = make_trainer(out, tokenizer, cls=cls, **EPOCHS, **exgrpo, **config)
    trainer.train(resume_from_checkpoint=str(out / "out" / f"checkpoint-{step}"))
    return trainer


def _same_parameters(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def _log_rows(trainer) -> list[dict]:
    """The training log rows, without their timings (step_time) and without the end-of-training summary row, which
    describes the process that trained last (its train_loss averages that process's steps, its train_runtime too)."""
    return [{k: v for k, v in row.items() if k != "step_time"} for row in trainer.state.log_history
            if "train_runtime" not in row]  # fmt: skip


def test_resume_in_the_second_and_third_epoch_is_bitwise(tmp_path, tokenizer):
    """10 steps straight against resumes from step 5 (inside epoch 1), 8 (its end) and 9 (inside epoch 2): the same
    parameters bitwise and the same buffer. Plain GRPOTrainer resumed at step 5 does not end where it would have,
    while ExGRPOTrainer with replay_ratio=0 resumed there ends exactly where GRPOTrainer's straight run ends."""
    straight = make_trainer(tmp_path / "straight", tokenizer, **EPOCHS, **AT_ONCE, max_steps=10)
    straight.train()
    assert straight.exgrpo_state.buffer.retired and straight.exgrpo_state.buffer.num_trajectories > 0
    for step in (5, 8, 9):
        resumed = _resume(tmp_path, tmp_path / "straight", f"from{step}", step, tokenizer, max_steps=10)
        assert resumed.state.global_step == 10
        assert _same_parameters(straight, resumed), f"resumed from checkpoint-{step}"
        assert state_of(resumed.exgrpo_state.buffer) == state_of(straight.exgrpo_state.buffer)
        assert resumed.exgrpo_state.state_dict() == straight.exgrpo_state.state_dict()
        assert _log_rows(resumed) == _log_rows(straight), f"resumed from checkpoint-{step}"

    grpo = make_trainer(tmp_path / "grpo", tokenizer, cls=GRPOTrainer, **EPOCHS, max_steps=10)
    grpo.train()
    grpo_resumed = _resume(tmp_path, tmp_path / "grpo", "grpo5", 5, tokenizer, GRPOTrainer, max_steps=10)
    assert not _same_parameters(grpo, grpo_resumed)  # GRPOTrainer's own flaw: epoch 1 drawn in epoch 0's order

    rho0 = make_trainer(tmp_path / "rho0", tokenizer, **EPOCHS, **AT_ONCE, max_steps=10, replay_ratio=0.0)
    rho0.train()
    assert _same_parameters(rho0, grpo)
    rho0_resumed = _resume(tmp_path, tmp_path / "rho0", "rho0from5", 5, tokenizer, max_steps=10, replay_ratio=0.0)
    assert _same_parameters(rho0_resumed, grpo)


def test_resume_with_a_reuse_limit_is_bitwise(tmp_path, tokenizer):
    """replay_cooldown's record (the generation batch each question was last replayed in, on the run's clock) is
    training state: resumed from step 3 of 6, the run draws what the straight run draws, ending with the same
    parameters, the same buffer and the same clock."""
    limited = dict(max_steps=6, replay_cooldown=1)
    straight = make_trainer(tmp_path / "straight", tokenizer, **EPOCHS, **AT_ONCE, **limited)
    straight.train()
    buffer = straight.exgrpo_state.buffer
    # a draw a step (one generation batch a step), questions replayed
    assert [t for t, _ in buffer.recent] == list(range(6)) and buffer.replayed_at
    resumed = _resume(tmp_path, tmp_path / "straight", "from3", 3, tokenizer, **limited)
    assert _same_parameters(straight, resumed)
    assert state_of(resumed.exgrpo_state.buffer) == state_of(buffer)  # replayed_at and recent included (state_meta)
    again = resumed.exgrpo_state.buffer
    assert (list(again.recent), again.replayed_at) == (list(buffer.recent), buffer.replayed_at)
    assert resumed.exgrpo_state.clock == straight.exgrpo_state.clock == 6


def test_resumed_at_max_steps_trains_nothing(tmp_path, tokenizer):
    """Resumed from its last checkpoint, a finished run takes no step (transformers took one more each time)."""
    run = make_trainer(tmp_path / "run", tokenizer, **EPOCHS, **AT_ONCE, max_steps=6)  # 6 is inside the second epoch
    run.train()
    weights = [p.detach().clone() for p in run.model.parameters()]
    again = make_trainer(tmp_path / "run", tokenizer, **EPOCHS, **AT_ONCE, max_steps=6)
    output = again.train(resume_from_checkpoint=str(tmp_path / "run" / "out" / "checkpoint-6"))
    assert again.state.global_step == 6 == output.global_step
    assert not (tmp_path / "run" / "out" / "checkpoint-7").exists()
    assert all(torch.equal(p, q) for p, q in zip(weights, again.model.parameters()))  # the checkpoint's weights
    assert state_of(again.exgrpo_state.buffer) == state_of(run.exgrpo_state.buffer)


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path, tokenizer):
    """A kill during rotation leaves a checkpoint half-deleted, with the freshest folder time. Rotation used to keep
    it (transformers orders by time) and delete complete ones; now incomplete ones go first, then the oldest by step.
    A leftover temporary state folder is removed at the next save."""
    out = tmp_path / "run" / "out"
    make_trainer(
        tmp_path / "run", tokenizer, **EPOCHS, **AT_ONCE, max_steps=4, save_total_limit=0
    ).train()  # keep every checkpoint
    leftover = out / "checkpoint-4" / f".{STATE_DIRNAME}.tmp-999999"  # a process killed inside save_state
    shutil.copytree(out / "checkpoint-4" / STATE_DIRNAME, leftover)
    # checkpoint-3 half-deleted by an interrupted rotation: its weights and optimizer gone, its time the newest
    for name in ("model.safetensors", "optimizer.pt"):
        (out / "checkpoint-3" / name).unlink()
    now = time.time()  # folder times a few seconds apart (transformers orders by step when they are within 1 s)
    for step in (1, 2, 4):
        os.utime(out / f"checkpoint-{step}", (now - 10 + step, now - 10 + step))
    os.utime(out / "checkpoint-3", (now, now))

    from transformers.trainer_utils import sort_checkpoints

    by_time = sort_checkpoints(str(out), use_mtime=True)
    assert by_time[-1].endswith("checkpoint-3")  # what transformers' rotation would have protected

    resumed = make_trainer(tmp_path / "run", tokenizer, **EPOCHS, **AT_ONCE, max_steps=6, save_total_limit=3)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    # at step 5: 3 (incomplete) deleted first, then 1 (the oldest complete); at step 6: 2
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5", "checkpoint-6"]
    assert not leftover.exists() and not list(out.glob(f"checkpoint-*/.{STATE_DIRNAME}.tmp-*"))
    assert not any(checkpoint_problems(out / f"checkpoint-{step}") for step in (4, 5, 6))


def test_rotate_checkpoints_by_hand(tmp_path, tokenizer):
    out = tmp_path / "run" / "out"
    make_trainer(tmp_path / "run", tokenizer, **EPOCHS, **AT_ONCE, max_steps=4, save_total_limit=0).train()
    (out / "checkpoint-4" / "trainer_state.json").write_text("{")  # cut short
    # limit 2, the newest (incomplete) one kept as the current checkpoint: 4 kept, 3 kept, 1 and 2 deleted
    deleted = rotate_checkpoints(out, 2, keep=[out / "checkpoint-4"])
    assert sorted(os.path.basename(p) for p in deleted) == ["checkpoint-1", "checkpoint-2"]
    # not kept: the incomplete one goes first, the complete one stays
    assert [os.path.basename(p) for p in rotate_checkpoints(out, 2)] == ["checkpoint-4"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert rotate_checkpoints(out, 0) == [] and rotate_checkpoints(out, None) == []


@pytest.mark.parametrize(
    "settings, every",
    [
        # (save_steps, steps_per_generation, num_iterations, gradient_accumulation_steps) -> optimizer steps between
        # generations: spg * iterations micro-batches / GA micro-batches per optimizer step, reduced by their gcd
        ((3, 2, 1, 1), 2),  # 3 * 1 = 3 micro-batches is not a multiple of 2
        ((5, 4, 1, 2), 2),  # 5 * 2 = 10 is not a multiple of 4; every 4 / gcd(4, 2) = 2 optimizer steps
        ((2, 2, 3, 1), 6),  # 2 * 1 = 2, not a multiple of 2 * 3 = 6
    ],
)
def test_save_steps_inside_generation_batches_are_named(settings, every, tmp_path, tokenizer, caplog):
    save, spg, iterations, accumulation = settings
    batch = 8 * 4 * spg // accumulation  # rows per micro-batch so that a generation batch holds 4 x spg questions
    fields = dict(
        save_strategy="steps",
        save_steps=save,
        steps_per_generation=spg,
        num_iterations=iterations,
        gradient_accumulation_steps=accumulation,
        per_device_train_batch_size=batch,
    )
    kwargs = config_kwargs(tmp_path, **fields)
    message = save_steps_inside_generation_batches(ExGRPOConfig(**kwargs))
    assert message is not None and f"save_steps={save} " in message
    assert message.endswith(f"save_steps that are multiples of {every} resume exactly.")
    aligned = ExGRPOConfig(**{**kwargs, "save_steps": every * 3})
    assert save_steps_inside_generation_batches(aligned) is None
    with caplog.at_level(logging.WARNING):
        make_trainer(tmp_path, tokenizer, train_dataset=synthetic_dataset(n=16), **fields)
    assert message in caplog.text


def test_save_steps_of_other_strategies_are_not_judged(tmp_path):
    assert save_steps_inside_generation_batches(ExGRPOConfig(**config_kwargs(tmp_path, save_steps=3))) is None


def test_resume_does_not_report_tied_weights_as_missing(tmp_path, tokenizer):
    """The tiny model ties its embeddings; the checkpoint holds one of the two names, and transformers used to log
    "There were missing keys in the checkpoint model loaded: ['lm_head.weight']" on every resume."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    model = make_model(tokenizer)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    make_trainer(tmp_path, tokenizer, max_steps=1, save_strategy="steps", save_steps=1).train()
    handler = Collect(level=logging.WARNING)
    logger = logging.getLogger("transformers.trainer")
    logger.addHandler(handler)
    try:
        resumed = make_trainer(tmp_path, tokenizer, max_steps=2, save_strategy="steps", save_steps=1)
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "missing keys" in m], seen
    assert resumed.state.global_step == 2
    # a key that is really missing is still reported
    from torch.nn.modules.module import _IncompatibleKeys

    resumed._issue_warnings_after_load(_IncompatibleKeys(["lm_head.weight", "model.norm.weight"], []))
    logger.addHandler(handler)
    try:
        resumed._issue_warnings_after_load(_IncompatibleKeys(["lm_head.weight", "model.norm.weight"], []))
    finally:
        logger.removeHandler(handler)
    assert seen == ["There were missing keys in the checkpoint model loaded: ['model.norm.weight']."]
