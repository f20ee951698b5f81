"""Short training runs with replay on: the mixed groups, the buffer, retirement, delayed start, metrics, eval."""

import math

import pytest
import torch

from exgrpo_trl.buffer import question_key
from exgrpo_trl.replay import RowAssignment
from exgrpo_trl.trainer import REPLAYED_COLUMN, BatchKey, GenerationBatch
from tests.helpers import make_trainer, synthetic_dataset
from tests.support.recording import RecordingTrainer


def run(tmp_path, tokenizer, dataset=None, **overrides):
    config = {"replay_start_pass_rate": 0.0, **overrides}
    trainer = make_trainer(tmp_path, tokenizer, cls=RecordingTrainer, train_dataset=dataset, **config)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def replay_run(tmp_path_factory, tokenizer):
    return run(tmp_path_factory.mktemp("replay"), tokenizer, max_steps=6)


def test_mixed_groups(replay_run):
    k = 8
    replayed_batches = 0
    for batch in replay_run.batches:
        plan, out, before = batch["plan"], batch["output"], batch["before"]
        num_groups = len(batch["prompts"]) // k  # 32 rows -> 4 groups
        expected = min(before["questions"], math.floor(0.5 * num_groups))
        assert (0 if plan is None else len(plan.group_indices)) == expected
        replay_mask = out.get(BatchKey.REPLAY_MASK, torch.zeros(len(batch["prompts"]), dtype=torch.bool))
        assert int(replay_mask.sum()) == expected
        if plan is None:
            continue
        replayed_batches += 1
        assert plan.group_indices == list(range(num_groups - expected, num_groups))
        for j, group in enumerate(plan.group_indices):
            rows = range(group * k, (group + 1) * k)
            # exactly one stored trajectory (the group's first row) and K-1 fresh rollouts, all of the same question
            assert [bool(replay_mask[r]) for r in rows] == [True] + [False] * (k - 1)
            assert {question_key(batch["prompts"][r]) for r in rows} == {plan.keys[j]}
            slot = rows[0]
            length = int(out["completion_mask"][slot].sum())
            spliced = out["completion_ids"][slot, :length].tolist()
            assert spliced == plan.completion_ids[j]  # the selected trajectory, token for token
            assert spliced in before["trajectories"][plan.keys[j]]  # ... which was stored for that question
            logps = out[BatchKey.BEHAVIOUR_LOGPS][slot]
            assert torch.all(logps[:length] < 0) and torch.all(logps[length:] == 0)
            assert plan.keys[j] not in before["retired"]  # retired questions are never replayed
        assert len(set(plan.keys)) == len(plan.keys)
    assert replayed_batches >= 4


def test_buffer_grows_and_metrics_logged(replay_run):
    sizes = [b["buffer_after"] for b in replay_run.batches]
    assert sizes[0] == 0 and sizes[-1] > sizes[1] > 0, sizes  # collection lands after each batch's first pass
    history = [h for h in replay_run.state.log_history if "loss" in h]
    expected = {
        "exgrpo/buffer/questions",
        "exgrpo/buffer/trajectories",
        "exgrpo/buffer/retired",
        "exgrpo/replay/active",
        "exgrpo/replay/fraction",
        "exgrpo/replay/selected_entropy",
        "exgrpo/replay/is_weight_mean",
        "exgrpo/replay/is_weight_max",
        "exgrpo/replay/shaped_weight_mean",
    } | {f"exgrpo/buffer/bucket_{b}" for b in range(1, 8)}
    assert expected <= set(history[-1]), expected - set(history[-1])
    assert history[-1]["exgrpo/replay/fraction"] == 0.5
    # repeat share: per batch, the share of its replayed questions that the previous batch replayed too; fresh
    # all-fail: the share of the batch's fresh groups with no solved row
    previous: set = set()
    for batch in replay_run.batches:
        plan = batch["plan"]
        keys = plan.keys if plan is not None else []
        if plan is not None:
            assert plan.repeats == [key in previous for key in keys]
        previous = set(keys)
    assert 0.0 <= history[-1]["exgrpo/replay/repeat_share"] <= 1.0
    # reuse: replays per distinct replayed question over the draws so far (fewer than the window's 50)
    drawn = [key for batch in replay_run.batches if batch["plan"] is not None for key in batch["plan"].keys]
    assert replay_run.exgrpo_state.buffer.reuse() == pytest.approx(len(drawn) / len(set(drawn)))
    # the logged value of the last generation batch (one per logged step here) is that figure over its draws, which
    # brought questions back (so it is not 1 by construction)
    assert history[-1]["exgrpo/replay/reuse"] == pytest.approx(len(drawn) / len(set(drawn)), rel=1e-12)
    assert len(drawn) > len(set(drawn)), drawn
    assert 0.0 <= history[-1]["exgrpo/batch/fresh_all_fail"] <= 1.0
    assert history[-1]["exgrpo/buffer/questions"] == sum(history[-1][f"exgrpo/buffer/bucket_{b}"] for b in range(1, 8))
    # the completions table marks the replayed rows
    marks = replay_run._logs["extra"][REPLAYED_COLUMN]
    assert sum(bool(m) for m in marks) >= 2 and len(marks) == len(replay_run._logs["prompt"])


def test_reuse_limit_in_a_run(tmp_path, tokenizer):
    """replay_cooldown=1: a question replayed in one generation batch is never replayed in the next one, and a batch
    with fewer eligible questions than floor(rho * groups) replays fewer groups (the rest fresh). Resume is covered
    by the buffer's state (tests/algorithm/test_buffer.py) and the resume suites."""
    trainer = run(tmp_path, tokenizer, max_steps=8, replay_cooldown=1)
    previous: set = set()
    replayed = 0
    for batch in trainer.batches:
        plan = batch["plan"]
        keys = set(plan.keys) if plan is not None else set()
        assert not keys & previous, keys & previous
        assert len(keys) <= min(batch["before"]["questions"], 2)
        replayed += len(keys)
        previous = keys
    assert replayed >= 3
    buffer = trainer.exgrpo_state.buffer  # a draw in every generation batch, on the run's clock
    assert buffer.settings.replay_cooldown == 1 and [t for t, _ in buffer.recent] == list(range(len(trainer.batches)))


def test_behaviour_logps_are_the_generating_policys(tmp_path, tokenizer):
    """With lr = 0 the policy never moves, so every stored behaviour log-prob must equal the policy's log-prob of
    that token recomputed independently (float16 storage: |error| <= 5e-4 * |logp|), and replayed weights are 1."""
    trainer = run(tmp_path, tokenizer, max_steps=3, learning_rate=0.0)
    model = trainer.model.eval()
    checked = 0
    for entry in trainer.exgrpo_state.buffer.questions.values():
        prompt_ids = tokenizer(entry.row["prompt"])["input_ids"]
        for t in entry.trajectories:
            ids = torch.tensor([prompt_ids + t.completion_ids.tolist()])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
            reference = torch.log_softmax(logits.float(), -1).gather(
                -1, torch.tensor(t.completion_ids).long()[:, None]
            )
            stored = torch.tensor(t.logps.astype("float32"))
            assert torch.allclose(stored, reference[:, 0], atol=2e-3, rtol=1e-3)
            checked += 1
    assert checked > 5
    history = [h for h in trainer.state.log_history if "exgrpo/replay/is_weight_mean" in h]
    assert history and all(abs(h["exgrpo/replay/is_weight_mean"] - 1) < 5e-3 for h in history)


def test_retired_questions_are_skipped_from_the_next_epoch(tmp_path, tokenizer):
    # 16 questions, 4 groups per batch: epoch 1 is 4 batches. Every 4th question is always solved (K/K) and retires
    # when seen (replayed groups take the place of fresh ones, so some may go unseen in epoch 1); from epoch 2 on
    # the retired ones must not come back as fresh questions, and the epoch shrinks accordingly.
    dataset = synthetic_dataset(n=16, always_every=4)
    trainer = run(tmp_path, tokenizer, dataset=dataset, max_steps=8)
    epoch2 = trainer.batches[4:]
    retired_after_epoch1 = epoch2[0]["before"]["retired"]
    always = {question_key(p) for p, a in zip(dataset["prompt"], dataset["always"]) if a}
    assert retired_after_epoch1 and retired_after_epoch1 <= always
    for batch in epoch2:
        plan = batch["plan"]
        replayed = set(plan.group_indices) if plan else set()
        fresh = {question_key(batch["prompts"][g * 8]) for g in range(4) if g not in replayed}
        assert not fresh & retired_after_epoch1
    # The epoch keeps its 4 batches (a new pass over the remaining questions fills it), so max_steps is honoured.
    assert len(epoch2) == 4 and trainer.state.global_step == 8


def test_grpo_with_retired_questions_skipped(tmp_path, tokenizer):
    # replay_ratio 0 with skip_retired_without_replay: nothing is replayed, yet the retired questions (every 4th,
    # always solved) are not drawn fresh from epoch 2 on. Without the switch replay_ratio 0 is plain GRPO's sampler.
    from trl import GRPOTrainer
    from trl.trainer.utils import RepeatSampler

    dataset = synthetic_dataset(n=16, always_every=4)
    trainer = run(
        tmp_path, tokenizer, dataset=dataset, max_steps=8, replay_ratio=0.0, skip_retired_without_replay=True
    )
    assert all(b["plan"] is None for b in trainer.batches)
    retired = trainer.batches[4]["before"]["retired"]
    always = {question_key(p) for p, a in zip(dataset["prompt"], dataset["always"]) if a}
    assert retired == always  # every group fresh in epoch 1: each always-solved question was seen and retired
    for batch in trainer.batches[4:]:
        assert not {question_key(batch["prompts"][g * 8]) for g in range(4)} & retired
    plain = make_trainer(tmp_path / "plain", tokenizer, train_dataset=dataset, replay_ratio=0.0)
    # Without the switch nothing is skipped: the wrapper (there so that its place in the epochs is saved with
    # checkpoints) yields exactly TRL's sampler's indices, and never looks at the buffer's retired set.
    sampler = plain._get_train_sampler()
    assert sampler.retired is not plain.exgrpo_state.buffer.retired and not sampler.retired
    reference = GRPOTrainer._get_train_sampler(plain)
    assert type(reference) is RepeatSampler
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert list(sampler) == list(reference)


def test_revisit_without_replay(tmp_path, tokenizer):
    # replay_stored_trajectory=False: the questions replay draws come back with K fresh rollouts, no stored row, no
    # replayed-token loss; their fresh successes are collected like any other group's.
    trainer = run(tmp_path, tokenizer, max_steps=6, replay_stored_trajectory=False)
    revisited = 0
    for batch in trainer.batches:
        plan, out = batch["plan"], batch["output"]
        assert BatchKey.REPLAY_MASK not in out and batch["splice"] == {}
        assert batch["replay_rows"] == [-1] * len(batch["prompts"])
        if plan is None:
            continue
        assert not plan.with_trajectories and plan.selected_entropies == []
        for j, g in enumerate(plan.group_indices):
            assert batch["prompts"][g * 8 : (g + 1) * 8] == [plan.rows[j]["prompt"]] * 8
            assert plan.keys[j] in batch["before"]["trajectories"]  # drawn from the buffer
            revisited += 1
    assert revisited >= 4
    assert not [h for h in trainer.state.log_history if "exgrpo/replay/loss" in h]


def test_delayed_start(tmp_path, tokenizer):
    # Replay switches on after the first purely on-policy batch whose Pass@1 is strictly above the threshold, from
    # the next generation batch on, and stays on. The synthetic reward solves 30-60% of an untrained model's rollouts.
    on = run(tmp_path / "on", tokenizer, max_steps=4, replay_start_pass_rate=0.35)
    pass_at_1 = [h["exgrpo/batch/pass_at_1"] for h in on.state.log_history if "loss" in h]
    active = [b["before"]["active"] for b in on.batches]
    expected = [any(p > 0.35 for p in pass_at_1[:i]) for i in range(4)]
    assert active == expected and True in active and active[0] is False, (pass_at_1, active)
    switch = active.index(True)
    assert all(b["buffer_after"] == 0 for b in on.batches[:switch])  # nothing collected before the switch
    assert on.exgrpo_state.buffer.num_trajectories > 0 and on.exgrpo_state.replay_active
    off = run(tmp_path / "off", tokenizer, max_steps=3, replay_start_pass_rate=0.95)
    assert all(b["plan"] is None for b in off.batches)
    assert off.exgrpo_state.buffer.num_questions == 0 and not off.exgrpo_state.replay_active
    assert [h["exgrpo/replay/active"] for h in off.state.log_history if "loss" in h] == [0.0] * 3


def test_evaluation_never_replays_or_collects(tmp_path, tokenizer):
    trainer = run(tmp_path, tokenizer, max_steps=2, eval_strategy="no", per_device_eval_batch_size=16)
    buffer = trainer.exgrpo_state.buffer
    before = (buffer.num_questions, buffer.num_trajectories, set(buffer.retired), len(trainer.batches))
    metrics = trainer.evaluate(synthetic_dataset(n=8))
    assert (buffer.num_questions, buffer.num_trajectories, set(buffer.retired), len(trainer.batches)) == before
    assert "eval_exgrpo/replay/fraction" not in metrics and "eval_loss" in metrics


@pytest.mark.parametrize("selection", ["random", "highest_entropy"])
def test_selection_ablations_run(tmp_path, tokenizer, selection):
    trainer = run(
        tmp_path,
        tokenizer,
        max_steps=3,
        trajectory_selection=selection,
        question_selection="uniform",
        policy_shaping_gamma=None,
        replay_importance_correction=False,
    )
    assert any(b["plan"] is not None for b in trainer.batches)


@pytest.mark.parametrize(
    "backend, generated",
    [
        ({}, [1, 2]),  # transformers `generate`: the two spliced rows are left out
        ({"use_vllm": True, "vllm_mode": "colocate", "vllm_tensor_parallel_size": 1}, [1, 2]),
        ({"use_vllm": True, "vllm_mode": "colocate", "vllm_tensor_parallel_size": 2}, [0, 1, 2, 3]),  # equal shares
        ({"use_vllm": True, "vllm_mode": "server"}, [0, 1, 2, 3]),  # the server makes K per distinct prompt
    ],
)
def test_spliced_rows_are_not_generated(tmp_path, tokenizer, monkeypatch, backend, generated):
    from trl import GRPOTrainer

    trainer = make_trainer(tmp_path, tokenizer)
    seen = []

    def fake_generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        seen.append([p[0] for p in prompt_ids])
        # completion of a row = [its prompt's marker, 2]; vLLM-style log-probs [-marker / 10, -0.2]
        return [[p[0], 2] for p in prompt_ids], [[-p[0] / 10, -0.2] for p in prompt_ids]

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", fake_generate)
    for name, value in backend.items():
        setattr(trainer, name, value)
    prompts = [[10], [11], [12], [13]]  # one marker token per row
    batch = GenerationBatch(0, None, RowAssignment([{}] * 4, [0, -1, -1, 1], {0: [7, 7, 7], 3: [8]}))
    with trainer.exgrpo_run.opened(batch):
        ids, logprobs = trainer._generate_single_turn(prompts, None, {}, 8)
    assert seen == [[10 + i for i in generated]]
    assert ids == [[7, 7, 7], [11, 2], [12, 2], [8]]
    assert logprobs == [[None] * 3, [-1.1, -0.2], [-1.2, -0.2], [None]]

    # a rank whose rows are all spliced still generates (ZeRO-3's synced decoding needs every rank in `generate`)
    seen.clear()
    batch = GenerationBatch(0, None, RowAssignment([{}] * 4, [0, 1, 2, 3], {i: [7] for i in range(4)}))
    with trainer.exgrpo_run.opened(batch):
        trainer._generate_single_turn(prompts, None, {}, 8)
    assert seen == [[10, 11, 12, 13]]


def test_every_training_row_carries_the_exgrpo_metrics_and_counts_are_gauges(tmp_path, tokenizer):
    """TRL averages each metric over the logging window; counts and switches were averaged too (a buffer of 15.8
    questions, replay 0.8 active), and a row whose window held no generation batch (two updates a batch) had no
    ExGRPO key at all. Now every training row carries them, the counts being the buffer at that step."""
    from transformers import TrainerCallback

    seen = []

    class AtLog(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # right after the row is made
            if "loss" in logs:
                buffer = trainer.exgrpo_state.buffer
                seen.append((logs, buffer.num_questions, len(buffer.retired)))

    trainer = make_trainer(tmp_path, tokenizer, callbacks=[AtLog()], steps_per_generation=2, max_steps=6,
                           replay_start_pass_rate=None)  # fmt: skip
    trainer.train()
    assert len(seen) == 6  # one row per update, generation batches at updates 1, 3, 5 only
    keys = {"exgrpo/replay/active", "exgrpo/replay/fraction", "exgrpo/batch/pass_at_1", "exgrpo/buffer/questions",
            "exgrpo/buffer/retired"} | {f"exgrpo/buffer/bucket_{b}" for b in range(1, 8)}  # fmt: skip
    for logs, questions, retired in seen:
        assert keys <= set(logs), keys - set(logs)
        assert logs["exgrpo/buffer/questions"] == questions and logs["exgrpo/buffer/retired"] == retired
        assert logs["exgrpo/replay/active"] == 1.0  # replay from the first batch: a switch, never a mean
    assert seen[-1][1] > 0
