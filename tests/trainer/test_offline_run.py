"""Offline guidance in short training runs (algorithm §11): where the offline rows go, their weights, the solutions
the reward functions reject, the buffer, the `unsolved` rule, the metrics and the checks at init."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from exgrpo_trl import ExGRPOConfig
from exgrpo_trl.buffer import question_key
from exgrpo_trl.trainer import BatchKey
from tests.helpers import config_kwargs, make_trainer
from tests.support.recording import RecordingTrainer

K = 8


def offline_dataset(n: int = 32) -> Dataset:
    """Questions "a+b=" with a `solution` column of reference completions: every third question has none, every fourth
    first a solution the reward rejects (7 characters + EOS = 8 tokens: the synthetic reward solves completions of at
    most 6 tokens) then one it accepts, the rest one 2-character solution (3 tokens with EOS: solved)."""
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)][:n]
    solutions = [[] if i % 3 == 0 else ["1234567", "34"] if i % 4 == 1 else ["12"] for i in range(n)]
    return Dataset.from_dict({"prompt": prompts, "always": [False] * n, "solution": solutions})


def build(tmp_path, tokenizer, dataset=None, peft_config=None, **overrides) -> RecordingTrainer:
    """A recording trainer of the tiny model on `dataset` (`offline_dataset()`), offline solutions from `solution`."""
    config = {"offline_solutions_column": "solution", **overrides}
    dataset = dataset if dataset is not None else offline_dataset()
    return make_trainer(tmp_path, tokenizer, cls=RecordingTrainer, train_dataset=dataset, peft_config=peft_config,
                        **config)  # fmt: skip


def run(tmp_path, tokenizer, dataset=None, **overrides):
    trainer = build(tmp_path, tokenizer, dataset, **overrides)
    trainer.train()
    return trainer


def expected_ids(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


@pytest.fixture(scope="module")
def luffy_run(tmp_path_factory, tokenizer):
    """LUFFY inside the trainer: offline rows, replay off (replay_ratio 0), the buffer collecting from the first step;
    16 steps of 4 groups: the 32 questions twice."""
    return run(tmp_path_factory.mktemp("luffy"), tokenizer, replay_ratio=0.0, replay_start_pass_rate=0.0, max_steps=16)


def test_every_fresh_group_of_a_question_with_a_usable_solution_gets_it_as_its_first_row(luffy_run, tokenizer):
    dataset = offline_dataset()
    by_key = {question_key(p): s for p, s in zip(dataset["prompt"], dataset["solution"])}
    seen = 0
    for batch in luffy_run.batches:
        out, prompts = batch["output"], batch["prompts"]
        offline = out[BatchKey.OFFLINE]
        for group in range(len(prompts) // K):
            rows = range(group * K, (group + 1) * K)
            key = question_key(prompts[rows[0]])
            usable = [i for i in range(len(by_key[key])) if (key, i) not in batch["rejected_before"]]
            assert (rows[0] in batch["offline"]) == bool(usable)
            if not usable:
                assert not any(bool(out[BatchKey.REPLAY_MASK][r]) for r in rows)
                continue
            seen += 1
            assert batch["offline"][rows[0]] == (key, usable[0])  # the first solution not rejected
            text = by_key[key][usable[0]]
            ids = expected_ids(tokenizer, text)  # tokenized as the model's completion: the text, then EOS
            length = int(out["completion_mask"][rows[0]].sum())
            assert out["completion_ids"][rows[0], :length].tolist() == ids
            # behaviour log-prob 0 (probability 1) on every token; the other K - 1 rows are generated
            assert torch.all(out[BatchKey.BEHAVIOUR_LOGPS][rows[0]] == 0)
            solved = text in ("12", "34")
            # a solution the reward scores unsolved leaves the term and its row gets advantage 0 (no gradient)
            assert bool(offline[rows[0]]) == solved and bool(out[BatchKey.REPLAY_MASK][rows[0]]) == solved
            if not solved:
                assert float(out["advantages"][rows[0]]) == 0.0
            assert not any(bool(out[BatchKey.REPLAY_MASK][r]) for r in rows[1:])
    assert seen >= 10


def test_a_rejected_solution_is_never_used_again(luffy_run):
    dataset = offline_dataset()
    long_keys = {question_key(p) for p, s in zip(dataset["prompt"], dataset["solution"]) if s and s[0] == "1234567"}
    rejected = luffy_run.exgrpo_state.offline.rejected
    assert rejected and rejected <= {(key, 0) for key in long_keys}
    for batch in luffy_run.batches:
        for key, index in batch["offline"].values():
            assert (key, index) not in batch["rejected_before"]


def test_offline_rows_are_never_stored_and_count_in_k(luffy_run, tokenizer):
    eos = tokenizer.eos_token_id
    latest_k = {}
    for batch in luffy_run.batches:
        out = batch["output"]
        lengths = out["completion_mask"].sum(1).tolist()
        # the synthetic reward: solved when the completion ends with EOS within 6 tokens
        solved = [eos in out["completion_ids"][r, : int(n)].tolist() and n <= 6 for r, n in enumerate(lengths)]
        for group in range(len(solved) // K):
            latest_k[question_key(batch["prompts"][group * K])] = sum(solved[group * K : (group + 1) * K])
    buffer = luffy_run.exgrpo_state.buffer
    assert buffer.num_questions > 0
    for key, entry in buffer.questions.items():
        assert entry.k == latest_k[key]  # the offline row counted as a solved row of its group
        for trajectory in entry.trajectories:  # only the model's own rollouts are stored
            assert trajectory.completion_ids.tolist() not in (
                expected_ids(tokenizer, "12"),
                expected_ids(tokenizer, "34"),
            )
    assert all(latest_k[key] == K for key in buffer.retired)
    # the second visit of a question whose first solution was rejected uses the next one
    assert any(index == 1 for batch in luffy_run.batches for _, index in batch["offline"].values())


def test_offline_metrics_are_logged(luffy_run):
    rows = [h for h in luffy_run.state.log_history if "loss" in h]
    for name in ("exgrpo/offline/groups", "exgrpo/offline/unsolved", "exgrpo/offline/rejected"):
        assert all(name in h for h in rows), name
    assert any(h.get("exgrpo/offline/token_prob_mean", 0) > 0 for h in rows)
    # the shaped weight of an offline token is p / (p + 0.1) < 1
    assert all(
        0 < h["exgrpo/offline/shaped_weight_mean"] < 1 for h in rows if "exgrpo/offline/shaped_weight_mean" in h
    )
    assert rows[-1]["exgrpo/offline/rejected"] == len(luffy_run.exgrpo_state.offline.rejected)


def test_unsolved_rule_skips_questions_the_model_has_solved(tmp_path, tokenizer):
    trainer = run(tmp_path, tokenizer, offline_guidance="unsolved", replay_start_pass_rate=0.0, max_steps=8)
    for batch in trainer.batches:
        for key, _ in batch["offline"].values():
            assert key not in batch["self_solved_before"] and key not in batch["before"]["retired"]
    assert trainer.exgrpo_state.offline.self_solved  # the model solved some questions itself: no guidance for them


def test_init_checks(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="offline_solutions_column 'target' is not a column of the train_dataset"):
        build(tmp_path, tokenizer, offline_solutions_column="target")
    with pytest.raises(ValueError, match="offline_guidance must be one of"):
        ExGRPOConfig(**config_kwargs(tmp_path, offline_guidance="some"))


def _resumable(out, tokenizer, **overrides):
    return build(out, tokenizer, offline_dataset(16), save_strategy="steps", save_steps=1,  # 4 questions a step
                 replay_start_pass_rate=0.0, offline_guidance="unsolved", **overrides)  # fmt: skip


def test_resume_with_offline_rows_is_bitwise(tmp_path, tokenizer):
    """10 steps straight (replay and offline rows, the `unsolved` rule) against resumes from step 5 (inside the
    second epoch) and 9 (inside the third): the same parameters bitwise, the same buffer, and the same offline state
    (rejected solutions, questions the model solved itself)."""
    import shutil

    from tests.helpers import state_of

    straight = _resumable(tmp_path / "straight", tokenizer, max_steps=10)
    straight.train()
    guide = straight.exgrpo_state.offline
    assert guide.rejected and guide.self_solved
    assert any(batch["offline"] for batch in straight.batches[4:])  # offline rows after the first epoch too
    for step in (5, 9):
        out = tmp_path / f"from{step}"
        shutil.copytree(tmp_path / "straight" / "out" / f"checkpoint-{step}", out / "out" / f"checkpoint-{step}")
        resumed = _resumable(out, tokenizer, max_steps=10)
        resumed.train(resume_from_checkpoint=str(out / "out" / f"checkpoint-{step}"))
        assert all(torch.equal(p, q) for p, q in zip(straight.model.parameters(), resumed.model.parameters()))
        assert state_of(resumed.exgrpo_state.buffer) == state_of(straight.exgrpo_state.buffer)
        assert (resumed.exgrpo_state.offline.rejected, resumed.exgrpo_state.offline.self_solved) == (
            guide.rejected,
            guide.self_solved,
        )


def test_offline_rows_with_lora(tmp_path, tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = build(tmp_path, tokenizer, peft_config=lora, replay_start_pass_rate=0.0, max_steps=3)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert type(trainer.model).__name__ == "PeftModelForCausalLM"
    assert sum(bool(out) for out in (b["output"][BatchKey.OFFLINE].any() for b in trainer.batches)) >= 2
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the adapter trained
    rows = [h for h in trainer.state.log_history if "exgrpo/offline/token_prob_mean" in h]
    assert rows and all(0 < h["exgrpo/offline/token_prob_mean"] <= 1 for h in rows)
