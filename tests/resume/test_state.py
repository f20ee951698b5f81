"""The buffer is training state: save/load round trip, clear errors for bad files, bitwise resume."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch

from exgrpo_trl.buffer import ExperienceBuffer, Trajectory
from exgrpo_trl.draw import choose_questions
from exgrpo_trl.state_file import ARRAYS_FILENAME, META_FILENAME, STATE_DIRNAME, StateFileError, load_state, save_state
from tests.helpers import make_trainer, synthetic_dataset


def sample_buffer(seed=0):
    rng = np.random.default_rng(seed)
    buffer = ExperienceBuffer(8, seed=seed)
    for q in range(12):
        trajs = []
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(1, 9))
            trajs.append(Trajectory(rng.integers(0, 50, size=n), -rng.random(n), collected_at=q))
        buffer.update_group(
            f"q{q}", int(rng.integers(1, 8)), {"prompt": f"{q}+1=", "answer": str(q + 1), "n": q}, trajs
        )
    buffer.retire("q3")
    buffer.retire("never-stored")
    choose_questions(buffer, 4, clock=0)  # advance the generator: its state must survive too
    return buffer


def state_of(buffer):
    arrays, meta = buffer.state_dict()
    return {k: v.tolist() for k, v in arrays.items()}, json.loads(json.dumps(meta))


def test_round_trip(tmp_path):
    buffer = sample_buffer()
    path = save_state(tmp_path, buffer, {"replay_active": True, "generation_batches": 7, "sampler_passes": [["a"]]})
    assert sorted(p.name for p in path.iterdir()) == [ARRAYS_FILENAME, META_FILENAME]
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary folder was renamed into place
    restored = ExperienceBuffer(8, seed=99)
    trainer_state = load_state(tmp_path, restored)
    assert trainer_state == {"replay_active": True, "generation_batches": 7, "sampler_passes": [["a"]]}
    assert state_of(restored) == state_of(buffer)
    assert restored.bucket_counts() == buffer.bucket_counts() and restored.retired == buffer.retired
    assert choose_questions(restored, 5, clock=0) == choose_questions(buffer, 5, clock=0)  # same generator state
    other_rank = ExperienceBuffer(8)
    load_state(tmp_path, other_rank, with_trajectories=False)
    assert other_rank.retired == buffer.retired and other_rank.num_questions == 0
    # a stored token costs 6 bytes on disk too (plus the file header and per-trajectory length and step)
    tokens = buffer.num_tokens
    assert (path / ARRAYS_FILENAME).stat().st_size < 6 * tokens + 16 * buffer.num_trajectories + 1024


def test_bucket_order_survives_round_trip(tmp_path):
    """Sampling draws by position inside a bucket, and a question moves to its bucket's end whenever its bucket is
    set again: a resumed buffer must keep those positions to draw the same questions."""
    buffer = ExperienceBuffer(8, seed=5)
    for q in "abcdef":
        buffer.update_group(q, 4, {"prompt": q}, [Trajectory(np.array([ord(q)]), np.array([-1.0]), 0)])
    buffer.update_group("a", 4)
    buffer.update_group("c", 4)  # a, then c, move to the end of bucket 4
    assert list(buffer._buckets[4]) == list("bdefac") and list(buffer.questions) == list("abcdef")
    save_state(tmp_path, buffer, {})
    restored = ExperienceBuffer(8, seed=0)
    load_state(tmp_path, restored)
    assert list(restored._buckets[4]) == list("bdefac")
    assert [choose_questions(restored, 2, 0) for _ in range(10)] == [choose_questions(buffer, 2, 0) for _ in range(10)]

    # a state saved before positions were recorded restores its buckets in buffer order
    arrays, meta = buffer.state_dict()
    for q in meta["questions"]:
        del q["bucket_position"]
    old = ExperienceBuffer(8)
    old.load_state_dict(arrays, meta)
    assert list(old._buckets[4]) == list("abcdef")


def test_no_pickle(tmp_path):
    save_state(tmp_path, sample_buffer(), {})
    for f in (tmp_path / STATE_DIRNAME).iterdir():
        assert b"\x80\x04\x95" not in f.read_bytes() and b"\x80\x05\x95" not in f.read_bytes()  # pickle protocol 4/5


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / ARRAYS_FILENAME).unlink(), "buffer file is missing: .*buffer.safetensors"),
        (lambda d: (d / META_FILENAME).unlink(), "state file is missing: .*state.json"),
        (
            lambda d: (d / ARRAYS_FILENAME).write_bytes((d / ARRAYS_FILENAME).read_bytes()[:-10]),
            "truncated or corrupted: .*buffer.safetensors",
        ),
        (
            lambda d: (d / META_FILENAME).write_text((d / META_FILENAME).read_text()[:-5]),
            "truncated or corrupted: .*state.json",
        ),
        (lambda d: _flip_last_byte(d / ARRAYS_FILENAME), "corrupted \\(checksum of '.*'.*buffer.safetensors"),
        (lambda d: _edit_meta(d, format_version=99), "format version 99.*reads version 1"),
        (lambda d: _edit_meta(d, format="something-else"), "is not an ExGRPO state file"),
    ],
    ids=["no-arrays", "no-meta", "truncated-arrays", "truncated-meta", "bit-flip", "version", "format"],
)
def test_bad_files_raise_naming_the_file(tmp_path, damage, message):
    save_state(tmp_path, sample_buffer(), {})
    damage(tmp_path / STATE_DIRNAME)
    buffer = ExperienceBuffer(8)
    with pytest.raises(StateFileError, match=message):
        load_state(tmp_path, buffer)
    assert buffer.num_questions == 0


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_state_saved_before_the_stamps_were_named_collected_at_loads(tmp_path):
    # Before, each trajectory's stamp was saved as "steps" (state.json's list and the safetensors header); the bytes
    # and their CRC-32 are the same. Rename it back in both, padding the header with spaces to its length (which
    # safetensors allows), and the state loads into the same buffer; `exgrpo inspect` reads it too.
    from exgrpo_trl.cli.inspect import summarize
    from tests.helpers import state_of

    buffer = sample_buffer()
    save_state(tmp_path, buffer, {"replay_active": True, "generation_batches": 12})
    folder = tmp_path / STATE_DIRNAME
    data = (folder / ARRAYS_FILENAME).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["steps"] = header.pop("collected_at")
    old = json.dumps(header, separators=(",", ":")).encode()
    (folder / ARRAYS_FILENAME).write_bytes(data[:8] + old + b" " * (n - len(old)) + data[8 + n :])
    meta = json.loads((folder / META_FILENAME).read_text())
    meta["arrays"] = {("steps" if k == "collected_at" else k): v for k, v in meta["arrays"].items()}
    (folder / META_FILENAME).write_text(json.dumps(meta))
    assert "steps" in (folder / META_FILENAME).read_text() and b'"steps"' in (folder / ARRAYS_FILENAME).read_bytes()
    restored = ExperienceBuffer(8)
    load_state(tmp_path, restored)
    assert state_of(restored) == state_of(buffer)
    assert summarize(tmp_path, verify=True)["collected_steps"] == [0, 11]


def _edit_meta(directory, **changes):
    meta = json.loads((directory / META_FILENAME).read_text())
    meta.update(changes)
    (directory / META_FILENAME).write_text(json.dumps(meta))


def _set(*keys, value):
    """An edit of state.json's JSON setting the field at `keys` (object keys and array indices) to `value`."""

    def edit(meta):
        parent = meta
        for key in keys[:-1]:
            parent = parent[key]
        parent[keys[-1]] = value
        return meta

    return edit


def _drop(*keys):
    def edit(meta):
        parent = meta
        for key in keys[:-1]:
            parent = parent[key]
        del parent[keys[-1]]
        return meta

    return edit


# state.json holding valid JSON of the wrong shape: each edit of the saved JSON, and what the message says of it
WRONG_SHAPES = {
    "list": (lambda meta: [1, 2, 3], "malformed (it holds an array, expected an object)"),
    "only-format": (lambda meta: {"format": meta["format"]}, "incomplete (no 'format_version')"),
    "no-crc": (_drop("arrays", "lengths", "crc32"), "incomplete (no 'arrays.lengths.crc32')"),
    "arrays-number": (_set("arrays", value=5), "malformed ('arrays' is 5, expected an object)"),
    "no-num-generations": (
        _drop("buffer", "config", "num_generations"),
        "incomplete (no 'buffer.config.num_generations')",
    ),
    "retired-number": (_set("buffer", "retired", value=5), "malformed ('buffer.retired' is 5, expected an array)"),
    "count-string": (
        _set("buffer", "questions", 0, "num_trajectories", value="2"),
        "malformed ('buffer.questions[0].num_trajectories' is a string, expected a non-negative integer)",
    ),
    "negative-size": (
        _set("arrays", "logps", "size", value=-1),
        "malformed ('arrays.logps.size' is -1, expected a non-negative integer)",
    ),
    "trainer-list": (_set("trainer", value=[]), "malformed ('trainer' is an array, expected an object)"),
    "switch-number": (
        _set("trainer", "replay_active", value=1),
        "malformed ('trainer.replay_active' is 1, expected a boolean)",
    ),
    "pass-of-numbers": (
        _set("trainer", "sampler_passes", value=[[3]]),
        "malformed ('trainer.sampler_passes[0][0]' is 3, expected a string)",
    ),
    "no-processes": (
        _set("trainer", "num_processes", value=0),
        "malformed ('trainer.num_processes' is 0, expected a positive integer)",
    ),
    "latest-string": (
        _set("trainer", "latest", value={"batch/pass_at_1": "0.5"}),
        "malformed ('trainer.latest.batch/pass_at_1' is a string, expected a number)",
    ),
}


def edit_meta_json(path, edit):
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


@pytest.mark.parametrize("case", list(WRONG_SHAPES))
def test_wrong_shape_state_json_raises_naming_the_file(tmp_path, case):
    """Valid JSON of the wrong shape is a StateFileError naming the file and the field, on one line, whether the
    trajectories are loaded or not (a KeyError or TypeError before)."""
    edit, what = WRONG_SHAPES[case]
    save_state(tmp_path, sample_buffer(), {"replay_active": True, "generation_batches": 7, "sampler_passes": [["a"]]})
    path = tmp_path / STATE_DIRNAME / META_FILENAME
    edit_meta_json(path, edit)
    for with_trajectories in (True, False):
        buffer = ExperienceBuffer(8)
        with pytest.raises(StateFileError) as info:
            load_state(tmp_path, buffer, with_trajectories=with_trajectories)
        assert str(info.value) == f"ExGRPO state file is {what}: {path}"
        assert buffer.num_questions == 0 and not buffer.retired


def test_unserialisable_row_is_a_clear_error(tmp_path):
    buffer = ExperienceBuffer(8)
    buffer.update_group("q", 2, {"prompt": "x", "when": object()}, [Trajectory(np.arange(3), np.zeros(3), 0)])
    with pytest.raises(TypeError, match="holds a value of type object, which cannot be saved as JSON"):
        save_state(tmp_path, buffer, {})
    assert not (tmp_path / STATE_DIRNAME).exists()


# 16 questions, 4 a step; replay from the first step; checkpoints by steps
SMALL = dict(train_dataset=synthetic_dataset(n=16, always_every=4), save_strategy="steps", replay_start_pass_rate=0.0)


def test_resume_is_bitwise(tmp_path, tokenizer):
    """2N steps straight, and N steps + resume from that checkpoint + N more, end identical: parameters bitwise,
    buffers (arrays, rows, buckets, retired, generator) equal. N = 3 crosses an epoch (4 batches of 4 questions)."""
    straight = make_trainer(tmp_path / "a", tokenizer, **SMALL, max_steps=6, save_steps=3)
    straight.train()
    resumed_dir = tmp_path / "b"
    shutil.copytree(tmp_path / "a" / "out" / "checkpoint-3", resumed_dir / "out" / "checkpoint-3")
    resumed = make_trainer(resumed_dir, tokenizer, **SMALL, max_steps=6, save_steps=3)
    resumed.train(resume_from_checkpoint=str(resumed_dir / "out" / "checkpoint-3"))

    assert straight.exgrpo_state.buffer.num_trajectories > 0 and straight.exgrpo_state.buffer.retired
    assert state_of(resumed.exgrpo_state.buffer) == state_of(straight.exgrpo_state.buffer)
    assert resumed.exgrpo_state.state_dict() == straight.exgrpo_state.state_dict()
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name
    # the state in the final checkpoints agrees as well
    # (safetensors writes its header's metadata in hash order, so compare the arrays, byte for byte)
    from safetensors.numpy import load_file

    a_dir, b_dir = tmp_path / "a/out/checkpoint-6" / STATE_DIRNAME, resumed_dir / "out/checkpoint-6" / STATE_DIRNAME
    a, b = load_file(str(a_dir / ARRAYS_FILENAME)), load_file(str(b_dir / ARRAYS_FILENAME))
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert (a_dir / META_FILENAME).read_bytes() == (b_dir / META_FILENAME).read_bytes()


def test_resume_from_plain_grpo_checkpoint_warns_once(tmp_path, tokenizer, caplog):
    from trl import GRPOTrainer

    make_trainer(tmp_path, tokenizer, cls=GRPOTrainer, max_steps=2, save_strategy="steps", save_steps=2).train()
    trainer = make_trainer(tmp_path, tokenizer, max_steps=3, save_strategy="steps", save_steps=2)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    warnings = [r for r in caplog.records if "holds no ExGRPO state" in r.getMessage()]
    assert len(warnings) == 1 and trainer.state.global_step == 3
    assert not trainer.exgrpo_state.replay_active or trainer.exgrpo_state.buffer.num_questions <= 4
