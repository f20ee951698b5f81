"""Settings that used to train wrongly without a word: a success threshold that does not separate right
from wrong rollouts, and ExGRPO settings changed between a checkpoint and its resume."""

from __future__ import annotations

import logging

import pytest
import torch

from exgrpo_trl.buffer import ExperienceBuffer
from exgrpo_trl.replay import threshold_mismatch
from exgrpo_trl.state_file import load_state
from tests.helpers import make_reward, make_trainer, synthetic_dataset

ALL_SOLVED = (
    "ExGRPO: every rollout of this batch counts as solved (weighted total reward >= success_reward_threshold=1), yet "
    "rewards vary within groups (from 1 to 5): batch Pass@1 reads 1.0, every question is retired and the experience "
    "buffer stays empty. Set success_reward_threshold to the weighted total reward of a correct answer (here perhaps "
    "5)."
)
NONE_SOLVED = (
    "ExGRPO: no rollout of this batch counts as solved (weighted total reward >= success_reward_threshold=1), yet "
    "rewards vary within groups (from 0 to 0.5): nothing is stored in the experience buffer and the delayed start "
    "cannot be reached. Set success_reward_threshold to the weighted total reward of a correct answer (here perhaps "
    "0.5)."
)


def _check(rewards, threshold=1.0, weights=(1.0,), k=4):
    rewards = torch.tensor(rewards, dtype=torch.float32).reshape(-1, len(weights))
    weights = torch.tensor(weights)
    solved = (rewards * weights).nansum(dim=1) >= threshold
    return threshold_mismatch(rewards, weights, solved, threshold, k)


def test_threshold_mismatch_cases():
    assert _check([1, 5, 5, 1, 1, 1, 1, 1]) == ALL_SOLVED  # 1 + 4 * correct with the default threshold
    assert _check([0, 0.5, 0, 0, 0.5, 0.5, 0.5, 0.5]) == NONE_SOLVED  # a correct answer scores 0.5
    # two reward functions, weighted: totals 0 / 0.5
    assert _check([[0, 0], [1, 0], [0, 0], [0, 0]], weights=(0.5, 1.0)) == NONE_SOLVED
    assert _check([0, 1, 1, 0, 1, 1, 1, 1]) is None  # binary reward: the threshold separates them
    assert _check([0, 0, 0, 0, 0, 0, 0, 0]) is None  # nothing solved, nothing varies: a hard batch, no mistake seen
    assert _check([1, 1, 1, 1, 5, 5, 5, 5]) is None  # every group uniform: no group tells rollouts apart
    assert _check([0, 0.2, 1, 1, 0, 0, 0, 0]) is None  # some solved, some not


# two steps replaying from the first, on questions that are never solved whatever the completion
QUIET = dict(train_dataset=synthetic_dataset(always_every=1000), max_steps=2, replay_start_pass_rate=0.0)


def test_always_solved_reward_warns_once(tmp_path, tokenizer, caplog):
    binary = make_reward(tokenizer)

    def one_plus_four_correct(completion_ids, always, **kwargs):
        return [1.0 + 4.0 * r for r in binary(completion_ids, always)]

    trainer = make_trainer(tmp_path, tokenizer, reward_funcs=one_plus_four_correct, **QUIET)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "success_reward_threshold" in r.getMessage()]
    assert warnings == [ALL_SOLVED]  # two batches of the kind, one warning
    assert trainer.exgrpo_state.buffer.num_questions == 0 and trainer.exgrpo_state.buffer.retired  # what it warns of

    caplog.clear()
    fixed = make_trainer(
        tmp_path, tokenizer, reward_funcs=one_plus_four_correct, **QUIET, success_reward_threshold=5.0
    )
    with caplog.at_level(logging.WARNING):
        fixed.train()
    assert not [r for r in caplog.records if "success_reward_threshold" in r.getMessage()]
    assert fixed.exgrpo_state.buffer.num_questions > 0


# two steps replaying from the first, saved at the second (OUT/out/checkpoint-2)
SAVED = dict(max_steps=2, save_strategy="steps", save_steps=2, replay_start_pass_rate=0.0)


def test_resume_with_other_replay_settings_uses_the_config(tmp_path, tokenizer, caplog):
    """The buffer's contents and random state come from the checkpoint, its settings from the run's config (they used
    to be silently replaced by the saved ones while the model card reported the new ones), with one line saying so."""
    saved = make_trainer(tmp_path, tokenizer, **SAVED)
    saved.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert saved.exgrpo_state.buffer.num_questions > 0
    changed = dict(question_selection="uniform", replay_mu=0.25, replay_sigma=2.0)
    resumed = make_trainer(tmp_path, tokenizer, **{**SAVED, **changed, "max_steps": 3})
    restored = []  # the buffer as the resume left it, before training goes on
    load = resumed._load_optimizer_and_scheduler
    resumed._load_optimizer_and_scheduler = lambda c: (
        load(c),
        restored.append(resumed.exgrpo_state.buffer.state_meta()),
    )
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    buffer = resumed.exgrpo_state.buffer
    s = buffer.settings
    assert (s.question_selection, s.replay_mu, s.replay_sigma) == ("uniform", 0.25, 2.0)
    as_saved = ExperienceBuffer(8)
    load_state(checkpoint, as_saved)
    expected_meta = as_saved.state_meta()
    (meta,) = restored
    assert meta["config"] == {**expected_meta["config"], "question_selection": "uniform", "mu": 0.25, "sigma": 2.0}
    assert {k: v for k, v in meta.items() if k != "config"} == {
        k: v for k, v in expected_meta.items() if k != "config"
    }
    lines = [r.getMessage() for r in caplog.records if "other replay settings" in r.getMessage()]
    assert lines == [
        f"ExGRPO: {checkpoint} was saved with other replay settings; this run's config is used "
        "(replay_mu 0.5 -> 0.25, replay_sigma 1.0 -> 2.0, question_selection 'gaussian' -> 'uniform'). The buffer's "
        "questions, trajectories and random state are restored as saved."
    ]
    resumed.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| question selection | uniform |" in card
    assert "| bucket Gaussian centre (mu, a success rate) | 0.25 |" in card


def test_resume_with_the_same_settings_says_nothing(tmp_path, tokenizer, caplog):
    make_trainer(tmp_path, tokenizer, **SAVED).train()
    resumed = make_trainer(tmp_path, tokenizer, **SAVED)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert not [r for r in caplog.records if "other replay settings" in r.getMessage()]


def test_resume_with_other_num_generations_fails_clearly(tmp_path, tokenizer):
    make_trainer(tmp_path, tokenizer, **SAVED).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    resumed = make_trainer(tmp_path, tokenizer, **SAVED, num_generations=4)
    with pytest.raises(ValueError) as info:
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert str(info.value) == (
        f"{checkpoint} was trained with num_generations=8, this run uses 4: its experience buffer's success counts do "
        "not carry over. Resume with num_generations=8, or start a fresh run in another output_dir."
    )


@pytest.mark.parametrize(
    "capability, avx512_bf16, amx, expected",
    [
        ("AVX2", True, False, "AVX2"),  # kernels chosen below the CPU (ATEN_CPU_CAPABILITY=avx2): no bf16 in them
        ("AVX512", False, False, "AVX512"),  # AVX-512 without its BF16 extension
        ("AVX512", True, False, None),  # AVX512_BF16: native
        ("AVX512", False, True, None),  # AMX: native
        ("DEFAULT", False, False, "DEFAULT"),
        ("SVE256", False, False, None),  # not an x86 CPU: not known, no warning
    ],
)
def test_which_cpu_kernels_emulate_bf16(monkeypatch, capability, avx512_bf16, amx, expected):
    from exgrpo_trl.checks import cpu_bf16_kernels

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert cpu_bf16_kernels() == expected


def test_the_kernels_torch_runs_are_read(tmp_path):
    """What torch reports is what decides: the same CPU, its kernels forced down to AVX2, emulates bf16."""
    import os
    import subprocess
    import sys

    code = "from exgrpo_trl.checks import cpu_bf16_kernels as k; print(k())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "AVX2", run.stderr[-2000:]


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_on_a_cpu_that_emulates_it_is_said_at_start(tmp_path, tokenizer, caplog, monkeypatch, bf16):
    """One line at init, as TRL's default bf16=True would otherwise slow a CPU run 5-9 times unseen (the text quick
    start's 20 updates: 15.9 s on AVX2 kernels, 2.2 s with bf16 and activation checkpointing off)."""
    from exgrpo_trl import checks

    monkeypatch.setattr(checks, "cpu_bf16_kernels", lambda: "AVX2")
    with caplog.at_level(logging.WARNING):
        make_trainer(tmp_path, tokenizer, bf16=bf16)
    lines = [r.getMessage() for r in caplog.records if "no native bf16" in r.getMessage()]
    expected = (
        "ExGRPO: bf16=True on a CPU whose torch kernels (AVX2) have no native bf16: every step emulates it, 5-9x "
        "slower than float32 on the CPU quick starts; set bf16=False (and activation_checkpointing=False, which on a "
        "CPU only adds a second forward pass)."
    )
    assert lines == ([expected] if bf16 else [])
