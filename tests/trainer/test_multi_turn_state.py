"""Multi-turn trajectories in the buffer and its saved state: the model mask and the record, state format 2.

A tool-calling or environment trajectory keeps a per-token model mask (1: the model's token, 0: a tool's or an
environment's) and a record (what the reward functions saw beyond the token ids). They are saved in format 2: the
mask as a uint8 array beside the token ids, the records in state.json. A single-turn buffer is still written in
format 1, with exactly the arrays it always had, and a format-1 state loads as all-model tokens.
"""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from exgrpo_trl.buffer import ExperienceBuffer, Trajectory, shortlist_candidates
from exgrpo_trl.cli.inspect import main as inspect_main
from exgrpo_trl.cli.inspect import summarize
from exgrpo_trl.replay import GroupOutcome, StoredRow, assign_rows, batch_outcome, collect, commit
from exgrpo_trl.state_file import (
    ARRAYS_FILENAME,
    META_FILENAME,
    STATE_DIRNAME,
    StateFileError,
    load_state,
    read_meta,
    save_state,
)

EOS = 1
RECORD = {
    "completion": [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add"}}]},
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "assistant", "content": "7"},
    ]
}


def multi_turn(ids, logps, mask, step=0, record=RECORD):
    return Trajectory(np.array(ids), np.array(logps), step, np.array(mask), record)


def test_mask_is_normalised_and_the_stored_nll_covers_the_models_tokens():
    t = multi_turn([5, 6, 7, EOS], [-1.0, -9.0, -9.0, -3.0], [1, 0, 0, 1])
    assert t.mask.dtype == np.uint8 and t.mask.tolist() == [1, 0, 0, 1]
    assert t.stored_nll() == pytest.approx(2.0)  # (1 + 3) / 2: the tool's tokens (-9) are not the model's
    assert t.model_mask().tolist() == [1, 0, 0, 1]
    single = Trajectory(np.array([5, EOS]), np.array([-1.0, -2.0]), 0, np.array([1, 1]))
    assert single.mask is None and single.model_mask().tolist() == [1, 1]  # all the model's: no mask kept
    with pytest.raises(ValueError, match="model mask"):
        Trajectory(np.array([5, EOS]), np.array([-1.0, -2.0]), 0, np.array([1, 1, 1]))
    # the shortlist ranks by the model tokens' NLL: 2.0 (tool tokens -9 ignored) beats 2.5 with M = 1
    plain = Trajectory(np.array([8, EOS]), np.array([-2.5, -2.5]), 0)
    assert shortlist_candidates([plain, t], 1) == [t]


def sample_buffer():
    buffer = ExperienceBuffer(8, seed=0)
    buffer.update_group("q0", 3, {"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"}, [
        multi_turn([5, 6, 7, EOS], [-1.0, -9.0, -9.0, -3.0], [1, 0, 0, 1], step=1),
        Trajectory(np.array([9, EOS]), np.array([-0.5, -0.25]), 2),  # no tool call: no mask, no record
    ])  # fmt: skip
    buffer.update_group("q1", 5, {"prompt": "1+1=", "answer": "2"}, [
        multi_turn([4, 4, EOS], [-1.0, -2.0, -0.5], [1, 0, 1], step=3, record={"rewards": {"Env": 1.0}}),
    ])  # fmt: skip
    buffer.retire("q9")
    return buffer


def test_format_2_round_trip(tmp_path):
    buffer = sample_buffer()
    save_state(tmp_path, buffer, {"replay_active": True})
    meta = read_meta(tmp_path)
    assert meta["format_version"] == 2
    arrays = load_file(str(tmp_path / STATE_DIRNAME / ARRAYS_FILENAME))
    assert arrays["model_mask"].dtype == np.uint8
    assert arrays["model_mask"].tolist() == [1, 0, 0, 1] + [1, 1] + [1, 0, 1]  # ones for the maskless trajectory
    assert meta["buffer"]["questions"][0]["records"] == [RECORD, None]

    restored = ExperienceBuffer(8, seed=5)
    load_state(tmp_path, restored)
    for key in ("q0", "q1"):
        for a, b in zip(buffer.questions[key].trajectories, restored.questions[key].trajectories):
            assert a.completion_ids.tolist() == b.completion_ids.tolist() and a.logps.tolist() == b.logps.tolist()
            assert (a.mask is None and b.mask is None) or a.mask.tolist() == b.mask.tolist()
            assert a.record == b.record and a.collected_at == b.collected_at
    # the in-memory state_dict round trip as well
    arrays, meta = buffer.state_dict()
    again = ExperienceBuffer(8)
    again.load_state_dict(arrays, json.loads(json.dumps(meta)))
    assert [t.mask is None for t in again.iter_trajectories()] == [False, True, False]
    assert [t.record for t in again.iter_trajectories()] == [RECORD, None, {"rewards": {"Env": 1.0}}]


def test_single_turn_state_stays_format_1(tmp_path):
    """A buffer without multi-turn trajectories is written as before (format 1, four arrays, no records), and a
    format-1 state loads with every token the model's."""
    buffer = ExperienceBuffer(8)
    buffer.update_group("q", 2, {"prompt": "1+1="}, [Trajectory(np.array([3, EOS]), np.array([-1.0, -2.0]), 0)])
    save_state(tmp_path, buffer, {})
    meta = read_meta(tmp_path)
    assert meta["format_version"] == 1
    assert sorted(meta["arrays"]) == ["collected_at", "completion_ids", "lengths", "logps"]
    assert "records" not in meta["buffer"]["questions"][0]
    header = json.loads((tmp_path / STATE_DIRNAME / ARRAYS_FILENAME).read_bytes()[8:].split(b"}}")[0] + b"}}")
    assert header["__metadata__"]["version"] == "1"
    restored = ExperienceBuffer(8)
    load_state(tmp_path, restored)
    (t,) = restored.iter_trajectories()
    assert t.mask is None and t.record is None and t.model_mask().tolist() == [1, 1]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(format_version=4), "format version 4, this version of exgrpo-trl reads version 1 or 2 or"),
        (lambda m: m["buffer"]["questions"][0].update(records="x"), r"'buffer.questions\[0\].records' is a string"),
        (lambda m: m["buffer"]["questions"][0].update(records=[1, None]), r"records\[0\]' is 1, expected an object"),
        (lambda m: m["buffer"]["questions"][0].update(records=[None]), "lists 2 trajectories but 1 records"),
    ],
    ids=["version", "records-not-array", "record-not-object", "records-count"],
)
def test_bad_format_2_states_raise(tmp_path, edit, message):
    save_state(tmp_path, sample_buffer(), {})
    path = tmp_path / STATE_DIRNAME / META_FILENAME
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(StateFileError, match=message):
        load_state(tmp_path, ExperienceBuffer(8))


def test_inspect_reads_a_format_2_state(tmp_path, capsys):
    checkpoint = tmp_path / "checkpoint-3"
    save_state(checkpoint, sample_buffer(), {"replay_active": True})
    s = summarize(checkpoint, verify=True)  # every array's CRC-32, the model mask's included
    assert (s["questions"], s["trajectories"], s["tokens"], s["format_version"]) == (2, 3, 9, 2)
    assert inspect_main([str(checkpoint), "--verify"]) == 0
    assert "format version 2" in capsys.readouterr().out
    # a damaged mask is caught like any other array
    data = (checkpoint / STATE_DIRNAME / ARRAYS_FILENAME).read_bytes()
    (checkpoint / STATE_DIRNAME / ARRAYS_FILENAME).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(StateFileError, match="checksum"):
        summarize(checkpoint, verify=True)


def test_collect_stores_only_what_the_model_ended():
    """K = 4, one group, every row solved but row 0: row 1 ends with the model's EOS (stored, with its record slot),
    row 2's last token is a tool's (a loop cut short after a tool answered: not stored), row 3 has no mask."""
    k = 4
    rows = assign_rows([{"prompt": "p"}] * 4, None, process_index=0, k=k)
    outcome = batch_outcome(torch.tensor([0.0, 1, 1, 1])[:, None], torch.ones(1), 1.0, k)
    completions = [[5, EOS], [5, 6, EOS], [5, EOS, 6], [7, EOS]]
    masks = [[1, 1], [1, 0, 1], [1, 1, 0], None]
    pending = collect(
        rows, outcome, completions, process_index=0, k=k, collecting=True, stop_ids={EOS},
        micro_batches_left=1, clock=0, masks=masks,
    )  # fmt: skip
    assert sorted(pending.rows) == [1, 3]
    # ... whereas without masks row 2 (ending with 6, no stop token) was never a candidate either way
    assert sorted(collect(
        rows, outcome, [[5, EOS], [5, 6, EOS], [5, 6, EOS], [7, EOS]], process_index=0, k=k, collecting=True,
        stop_ids={EOS}, micro_batches_left=1, clock=0,
    ).rows) == [1, 2, 3]  # fmt: skip


def test_commit_keeps_masks_and_records():
    buffer = ExperienceBuffer(4)
    gathered = [
        (
            [GroupOutcome(0, "a", 2, {"prompt": "a"})],
            [StoredRow(1, "a", RECORD, [5, 6, EOS], [-1.0, -2.0, -3.0], [1, 0, 1])],
        )
    ]
    commit(buffer, gathered, collected_at=4, is_main_process=True, k=4)
    (t,) = buffer.questions["a"].trajectories
    assert t.mask.tolist() == [1, 0, 1] and t.record == RECORD and t.collected_at == 4
