"""The draw's optional rules in a training run: the advantage a stored success carries (derived by hand), each rule
acting in the logs, and each resumed bitwise from a checkpoint."""

import math
import shutil

import pytest
import torch

from tests.helpers import make_trainer, state_of


def _stored_advantages(trainer):
    buffer = trainer.exgrpo_state.buffer
    return [(entry.k, t.advantage) for entry in buffer.questions.values() for t in entry.trajectories]


@pytest.mark.parametrize("scale", ["none", "group"])
def test_a_stored_success_carries_the_advantage_trl_gave_it(tmp_path, tokenizer, scale):
    # One generation batch (4 questions x K = 8, replay from the first batch, nothing replayed yet: the buffer is
    # empty). A stored success of a group with k of K = 8 rows solved (reward 1, the others 0; no other reward):
    # scale_rewards "none": A = 1 - k / 8; "group": A = (1 - k / 8) / (std + 1e-4), std TRL's unbiased standard
    # deviation of k ones and 8 - k zeros, sqrt(k (8 - k) / (8 x 7)). Each question enters the buffer in this batch,
    # so its bucket is that k.
    trainer = make_trainer(tmp_path, tokenizer, max_steps=1, replay_start_pass_rate=0.0, scale_rewards=scale)
    trainer.train()
    stored = _stored_advantages(trainer)
    assert stored, "nothing stored: the test shows nothing"
    for k, advantage in stored:
        expected = 1 - k / 8
        if scale == "group":
            expected /= math.sqrt(k * (8 - k) / 56) + 1e-4
        assert advantage == pytest.approx(expected, rel=1e-6, abs=1e-6), (k, advantage)


RULES = {
    "age": {"replay_max_age": 2},
    "uses": {"replay_max_uses": 1},
    "advantage": {"replay_priority": "advantage"},
    "all three": {"replay_max_age": 2, "replay_max_uses": 2, "replay_priority": "advantage"},
}
# The default suite runs the three together (each acting, the whole state resumed); each alone is `slow`.
ALONE = [pytest.param(name, marks=pytest.mark.slow) for name in RULES if name != "all three"]


def _run(out, tokenizer, steps, **rule):
    return make_trainer(out, tokenizer, max_steps=steps, replay_start_pass_rate=0.0, save_strategy="steps",
                        save_steps=1, **rule)  # fmt: skip


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tokenizer):
    """The same 6 steps with every rule off: what the rules change is measured against it."""
    trainer = _run(tmp_path_factory.mktemp("plain"), tokenizer, 6)
    trainer.train()
    return trainer.exgrpo_state.buffer


@pytest.mark.parametrize("name", [*ALONE, "all three"])
def test_each_rule_acts_and_resumes_bitwise(tmp_path, tokenizer, name, plain):
    """6 steps straight against a resume from step 3: the same parameters bitwise and the same buffer (ages, use
    counts, advantages included); and the rule visibly acted in the straight run's logs."""
    rule = RULES[name]
    straight = _run(tmp_path / "straight", tokenizer, 6, **rule)
    straight.train()
    logs = [row for row in straight.state.log_history if "exgrpo/replay/fraction" in row]
    replayed = [row for row in logs if row["exgrpo/replay/fraction"] > 0]
    assert replayed, "nothing replayed: the test shows nothing"
    if "replay_max_age" in rule:  # a replayed trajectory is never older than the limit
        assert max(row["exgrpo/replay/age"] for row in replayed) <= rule["replay_max_age"]
    if "replay_max_uses" in rule:  # no trajectory replayed more often than the cap
        assert max(row["exgrpo/replay/uses"] for row in replayed) <= rule["replay_max_uses"]
    buffer = straight.exgrpo_state.buffer
    stamps = [t.collected_at for e in buffer.questions.values() for t in e.trajectories]
    plain_stamps = [t.collected_at for e in plain.questions.values() for t in e.trajectories]
    if "replay_max_age" in rule:  # the last draw (clock 5) dropped what was collected before 5 - 2 = 3; plain kept it
        assert min(stamps) >= 3 and min(plain_stamps) < 3
    if "replay_max_uses" in rule:  # a trajectory replayed up to the cap left the buffer; plain kept replayed ones
        cap = rule["replay_max_uses"]
        assert all(t.uses < cap for e in buffer.questions.values() for t in e.trajectories)
        assert max(t.uses for e in plain.questions.values() for t in e.trajectories) >= cap
    out = tmp_path / "from3"
    shutil.copytree(tmp_path / "straight" / "out" / "checkpoint-3", out / "out" / "checkpoint-3")
    resumed = _run(out, tokenizer, 6, **rule)
    resumed.train(resume_from_checkpoint=str(out / "out" / "checkpoint-3"))
    assert all(torch.equal(p, q) for p, q in zip(straight.model.parameters(), resumed.model.parameters()))
    assert state_of(resumed.exgrpo_state.buffer) == state_of(buffer)
    assert [t.uses for e in buffer.questions.values() for t in e.trajectories] == [
        t.uses for e in resumed.exgrpo_state.buffer.questions.values() for t in e.trajectories
    ]
