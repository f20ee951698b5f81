"""The contract with a user's rollouts: every shape TRL 1.16 accepts, trained under replay, and GRPOTrainer bit for
bit at replay_ratio=0.

The shapes are the rows of the table in docs/exgrpo_trainer.md ("What a rollout may be"); each row names the tests
that drive it, and `test_every_documented_shape_has_its_tests` fails for a row whose tests do not exist and for a
shape of this module that the table does not name. The rollout functions are those of tests/support/rollouts.py: the
trainer's own model sampling through `generate`, returning what TRL documents (`prompt_ids`, `completion_ids`,
`logprobs`) and, by shape, an `env_mask`, a per-row field the reward reads, `logprobs` of None, completions longer or
shorter than `max_completion_length`, or a vision-language model's prompts with their images.

Under replay (`test_shape_trains_under_replay`) each shape must show: replay fired (each generation batch after the
first replays floor(0.5 x 4) = 2 groups); the replayed row is its stored trajectory, as the reward functions saw it
and as it trains (ids, and TRL's tool mask where the function returned an `env_mask`); the per-row field the reward
got for a replayed row is the one the function returned for that very completion when it was collected (the row and
call it names in an earlier batch held the same ids); the replayed-token loss was logged finite; the policy moved.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from trl import GRPOTrainer

from tests.helpers import ROOT, make_model, make_reward, make_trainer, synthetic_dataset
from tests.support.recording import RecordingTrainer
from tests.support.rollouts import FieldLog, make_rollout
from tests.support.tool_tasks import one_thread

DOC = ROOT / "docs" / "exgrpo_trainer.md"
MAX_COMPLETION = 12  # tests.helpers.config_kwargs
SHAPES = {
    "rollout_func without env_mask": dict(),  # TRL's documented example: ids, log-probs and a field for the reward
    "rollout_func with env_mask": dict(env_mask=True),
    "rollout_func with logprobs None": dict(logprobs=None),
    "rollout_func without extra fields": dict(fields=False),
    "rollout_func longer than max_completion_length": dict(extra_tokens=6),
    "rollout_func shorter than max_completion_length": dict(extra_tokens=-6),
    "rollout_func with images in the prompt": dict(vision=True),
}


@pytest.fixture(autouse=True)
def _silence_trl_experimental(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


def train(tmp_path, shape: str, cls=RecordingTrainer, **config):
    """One run of `shape` with `cls`, 4 steps (the VLM: 6) of one generation batch each; returns (trainer, its
    FieldLog)."""
    spec = dict(SHAPES[shape])
    vision = spec.pop("vision", False)
    log = FieldLog()
    rollout = make_rollout(log=log, **spec)
    settings = dict(max_steps=4)
    if vision:
        from exgrpo_trl.tasks.vision import build_tiny_vlm, colour_dataset, colour_reward

        model, processing = build_tiny_vlm(seed=0)
        reward, dataset = colour_reward, colour_dataset(32, seed=1)
        settings.update(per_device_train_batch_size=16, num_generations=4, max_completion_length=4, max_steps=6)
    else:
        from exgrpo_trl.tasks.toy import build_char_tokenizer

        processing = build_char_tokenizer()
        model, reward, dataset = make_model(processing), make_reward(processing), synthetic_dataset()
    trainer = make_trainer(
        tmp_path, processing, cls=cls, model=model, reward_funcs=log.reward(reward), train_dataset=dataset,
        trainer_kwargs={"rollout_func": rollout}, **{**settings, **config},
    )  # fmt: skip
    trainer.initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with one_thread():
        trainer.train()
    return trainer, log


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shape_trains_under_replay(tmp_path, shape):
    trainer, log = train(tmp_path, shape, replay_start_pass_rate=0.0)
    k = trainer.num_generations
    spec = SHAPES[shape]
    replayed = [(b, j, g * k) for b, batch in enumerate(trainer.batches) if batch["plan"] is not None
                for j, g in enumerate(batch["plan"].group_indices)]  # fmt: skip
    # generation batches of 4 groups: the first collects, each later one replays min(#buffer questions,
    # floor(0.5 * 4) = 2) groups; the text task fills the buffer in one batch, the tiny VLM's colours more slowly
    counts = [len(b["plan"].group_indices) if b["plan"] else 0 for b in trainer.batches]
    assert counts == [0] + [min(b["before"]["questions"], 2) for b in trainer.batches[1:]]
    assert sum(counts) >= (3 if spec.get("vision") else 6), counts
    assert len(log.ids) == len(trainer.batches) == log.calls  # one call per generation batch
    for b, j, row in replayed:
        plan, out = trainer.batches[b]["plan"], trainer.batches[b]["output"]
        ids = plan.completion_ids[j]
        assert log.ids[b][row] == ids  # the reward functions scored the stored trajectory ...
        assert out["completion_ids"][row, : len(ids)].tolist() == ids  # ... and it is what trains
        assert out["completion_mask"][row].sum().item() == len(ids)
        if spec.get("env_mask"):  # TRL's tool mask: the stored row's model mask, first token the environment's
            assert out["tool_mask"][row, : len(ids)].tolist() == plan.mask(j) == [0] + [1] * (len(ids) - 1)
        else:
            assert "tool_mask" not in out
        if spec.get("fields", True):
            draw = plan.record(j)["fields"]["draw"]
            assert log.draws[b][row] == draw  # the field of the stored completion, not the one generated now
            call, source = map(int, draw.split(":"))
            assert call < b and log.ids[call][source] == ids  # returned for this very completion when collected
        else:
            assert log.draws[b] is None and "fields" not in plan.record(j)
    stored = list(trainer.exgrpo_state.buffer.iter_trajectories())
    assert stored and all(t.model_mask()[-1] == 1 for t in stored)
    if "extra_tokens" in spec:  # the function's lengths are kept: TRL pads to the longest, truncates nothing
        widths = [b["output"]["completion_ids"].shape[1] for b in trainer.batches]
        assert (max(widths) > MAX_COMPLETION) if spec["extra_tokens"] > 0 else (max(widths) <= MAX_COMPLETION - 6)
    replay_loss = [h["exgrpo/replay/loss"] for h in trainer.state.log_history if "exgrpo/replay/loss" in h]
    assert replay_loss and all(math.isfinite(x) for x in replay_loss)
    assert any(not torch.equal(p, trainer.initial[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shape_at_rho_zero_is_grpo(tmp_path, shape):
    """replay_ratio=0 with this rollout shape: the same weights and losses as GRPOTrainer, bit for bit, while the
    buffer collected."""
    grpo, _ = train(tmp_path / "grpo", shape, cls=GRPOTrainer, max_steps=3, learning_rate=1e-3)
    ex, _ = train(
        tmp_path / "ex", shape, replay_ratio=0.0, replay_start_pass_rate=0.0, max_steps=3, learning_rate=1e-3
    )
    assert ex.exgrpo_state.buffer.num_questions > 0
    for (name, p), (_, q) in zip(grpo.model.named_parameters(), ex.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert any(not torch.equal(p, ex.initial[n]) for n, p in ex.model.named_parameters())  # it trained
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(grpo) == losses(ex) and len(losses(ex)) == 3


# ------------------------------------------------------------------------------------------------ the table
TABLE = re.compile(r"<!-- rollout-shapes -->\n(.*?)<!-- /rollout-shapes -->", re.S)
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[([^\]]+)\])?`")


def documented_shapes() -> dict[str, list[tuple[str, str, str | None]]]:
    """The table's rows: shape -> the tests it names (file, function, parameter id or None)."""
    block = TABLE.search(DOC.read_text()).group(1)
    rows = {}
    for line in block.splitlines()[2:]:  # past the header and its rule
        shape = line.split("|")[1].strip().replace("`", "")
        rows[shape] = TEST_REF.findall(line)
    return rows


def test_every_documented_shape_has_its_tests():
    rows = documented_shapes()
    assert set(SHAPES) <= set(rows), set(SHAPES) - set(rows)  # every shape tested here is in the table
    for shape, refs in rows.items():
        assert refs, f"the table's row {shape!r} names no test"
        for path, function, param in refs:
            source = (ROOT / path).read_text()
            assert re.search(rf"^(async )?def {function}\(", source, re.M), f"{shape!r}: {path}::{function}"
            if path == "tests/trainer/test_rollout_shapes.py" and param is not None:
                assert param in SHAPES, f"{shape!r}: no shape {param!r} in {path}"
            elif param is not None:  # a case id of another module's parametrisation: its text is in the file
                assert f'"{param}"' in source, f"{shape!r}: no case {param!r} in {path}"
    assert Path(ROOT / "tests/trainer/test_rollout_shapes.py").exists()
