"""`exgrpo inspect CHECKPOINT_DIR`: the summary of a saved buffer, its plot, and clear errors for bad states."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from exgrpo_trl import cli
from exgrpo_trl.buffer import ExperienceBuffer, Trajectory
from exgrpo_trl.cli.inspect import main, plot, summarize
from exgrpo_trl.state_file import ARRAYS_FILENAME, META_FILENAME, STATE_DIRNAME, save_state
from tests.helpers import make_trainer, synthetic_dataset


def _traj(length, step):
    return Trajectory(np.arange(4, 4 + length), -np.linspace(0.1, 1.0, length), step)


@pytest.fixture
def checkpoint(tmp_path):
    """K = 8: q0 in bucket 2 (lengths 3, 5), q1 and q2 in bucket 4 (4; 2, 6, 7), q3 stored then retired, and one
    question retired without ever being stored. 3 questions, 6 trajectories, 27 tokens, 2 retired; collected in
    generation batches 1-6, saved at 7 (ages 6 to 1); q0's trajectories replayed twice and once."""
    buffer = ExperienceBuffer(8, seed=0)
    replayed = [_traj(3, 1), _traj(5, 2)]
    replayed[0].uses, replayed[1].uses = 2, 1
    buffer.update_group("q0", 2, {"prompt": "1+1="}, replayed)
    buffer.update_group("q1", 4, {"prompt": "2+2="}, [_traj(4, 3)])
    buffer.update_group("q2", 4, {"prompt": "3+3="}, [_traj(2, 4), _traj(6, 5), _traj(7, 6)])
    buffer.update_group("q3", 5, {"prompt": "4+4="}, [_traj(9, 2)])
    buffer.update_group("q3", 8)  # K/K: retired, its trajectory leaves the buffer
    buffer.retire("never-stored")
    directory = tmp_path / "checkpoint-12"
    save_state(directory, buffer, {"replay_active": True, "generation_batches": 7, "sampler_passes": []})
    return directory


EXPECTED_BUCKETS = {
    1: (0, 0, 0),
    2: (1, 2, 8),
    3: (0, 0, 0),
    4: (2, 4, 19),
    5: (0, 0, 0),
    6: (0, 0, 0),
    7: (0, 0, 0),
}


def test_summary_numbers(checkpoint):
    s = summarize(checkpoint)
    assert (s["questions"], s["trajectories"], s["retired"], s["tokens"]) == (3, 6, 2, 27)
    assert s["num_generations"] == 8 and s["format_version"] == 1
    got = {k: (b["questions"], b["trajectories"], b["tokens"]) for k, b in s["buckets"].items()}
    assert got == EXPECTED_BUCKETS
    assert s["length"] == {"mean": 4.5, "min": 2, "max": 7}
    assert s["collected_steps"] == [1, 6]
    state_dir = checkpoint / STATE_DIRNAME
    files = {name: (state_dir / name).stat().st_size for name in (ARRAYS_FILENAME, META_FILENAME)}
    assert s["bytes"] == {
        "token_data": 27 * 6,  # int32 id + float16 log-prob
        "per_token": 6.0,
        "per_trajectory_arrays": 6 * 16,  # int64 length + int64 step
        "files": files,
        "total_on_disk": sum(files.values()),
    }
    assert s["trainer"] == {"replay_active": True, "generation_batches": 7}
    # ages 7 - (1, 2, 3, 4, 5, 6) = 6 .. 1, median (3 + 4) / 2; uses 2 + 1 on two trajectories
    assert s["age"] == {"min": 1, "median": 3.5, "max": 6}
    assert s["uses"] == {"replays": 3, "replayed": 2, "max": 2}


def test_text_output(checkpoint, capsys):
    assert main([str(checkpoint)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ExGRPO state  ") and out[0].endswith(f"{STATE_DIRNAME}  (format version 1)")
    assert out[1:5] == [
        "questions     3",
        "trajectories  6",
        "retired       2",
        "stored tokens 27  (per trajectory: mean 4.5, min 2, max 7)",
    ]
    assert out[5].startswith("bytes         162 of token ids + log-probs (6.00 per token), 96 of lengths + stamps; ")
    assert out[6:12] == [
        "collected at  generation batches 1 to 6",
        "age           1 to 6 generation batches (median 3.5)",
        "replayed      3 replays of 2 stored trajectories (most: 2)",
        "draw rules    no age limit, no use cap, no reuse limit, priority gaussian",
        "replay        on; 7 generation batches so far",
        "buckets       k successes out of K=8:",
    ]
    rows = [line.split() for line in out[13:20]]
    assert [[int(x) for x in row] for row in rows] == [[k, *EXPECTED_BUCKETS[k]] for k in range(1, 8)]


def test_json_output_and_cli_dispatch(checkpoint, capsys):
    assert cli.main(["inspect", str(checkpoint), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["questions"] == 3 and data["tokens"] == 27 and data["buckets"]["4"]["trajectories"] == 4
    assert "_lengths" not in data
    # the state folder itself is accepted too
    assert main([str(checkpoint / STATE_DIRNAME), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trajectories"] == 6


def test_plot(checkpoint, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "buffer.png"
    assert main([str(checkpoint), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert f"plot          {png}" in capsys.readouterr().out


@pytest.mark.parametrize("lengths", [[], [3, 4]], ids=["empty", "lengths-3-and-4"])
def test_plot_axes_count_from_zero_in_whole_numbers(tmp_path, lengths):
    """Counts start at 0 (an empty buffer's y-axes ran -0.055..0.055) and every tick of a count or a length is a
    whole number (lengths 3 and 4 had ticks 2.25, 2.5, ...; the empty plot 0.2, 0.4, ...)."""
    pytest.importorskip("matplotlib")
    buffer = ExperienceBuffer(8)
    for i, n in enumerate(lengths):
        buffer.update_group(f"q{i}", 3, {"prompt": f"{i}+1="}, [_traj(n, i)])
    buffer.retire("q")
    save_state(tmp_path, buffer, {"replay_active": True, "generation_batches": 1})
    ax_buckets, ax_lengths = plot(summarize(tmp_path), tmp_path / "buffer.png").axes
    for ax in (ax_buckets, ax_lengths):
        assert ax.get_ylim()[0] == 0
        assert all(float(y).is_integer() for y in ax.get_yticks())
    assert all(float(x).is_integer() for x in ax_lengths.get_xticks())
    if not lengths:
        assert ax_buckets.get_ylim() == (0, 1) and ax_lengths.get_ylim() == (0, 1)


def test_reads_only_lengths_and_steps(checkpoint, monkeypatch):
    """Without --verify the token arrays are never read: break every way of reading them and it still works."""
    import safetensors
    import safetensors.numpy

    import exgrpo_trl.cli.inspect as inspect_module
    import exgrpo_trl.state_file as state_module

    def boom(*args, **kwargs):
        raise AssertionError("the whole buffer was read")

    for module, name in [
        (safetensors.numpy, "load_file"),
        (safetensors, "safe_open"),
        (state_module, "read_arrays"),
        (state_module, "read_trajectories"),
        (state_module, "load_state"),
        (inspect_module, "verify_arrays"),
    ]:
        monkeypatch.setattr(module, name, boom)
    # every array state.py reads goes through _read_into: count the bytes it is asked for
    real_read_into, requested = state_module._read_into, []

    def counting_read_into(fd, arrays, *args, **kwargs):
        requested.append(sum(a.nbytes for a in arrays))
        return real_read_into(fd, arrays, *args, **kwargs)

    monkeypatch.setattr(state_module, "_read_into", counting_read_into)
    assert summarize(checkpoint)["tokens"] == 27
    assert requested == [6 * 8, 6 * 8]  # 6 int64 lengths, 6 int64 steps; none of the 27 ids and log-probs
    with pytest.raises(AssertionError, match="whole buffer"):
        summarize(checkpoint, verify=True)


def test_imports_neither_torch_nor_trl(checkpoint):
    code = (
        "import sys; from exgrpo_trl.cli import main; rc = main(['inspect', sys.argv[1]]); "
        "assert rc == 0; bad = {'torch', 'trl', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr


def _edit_meta(state_dir, **changes):
    meta = json.loads((state_dir / META_FILENAME).read_text())
    meta.update(changes)
    (state_dir / META_FILENAME).write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / META_FILENAME).unlink(), r"state file is missing: .*state\.json"),
        (lambda d: (d / ARRAYS_FILENAME).unlink(), r"buffer file is missing: .*buffer\.safetensors"),
        (
            lambda d: (d / META_FILENAME).write_text((d / META_FILENAME).read_text()[:-5]),
            r"truncated or corrupted: .*state\.json",
        ),
        (
            lambda d: (d / ARRAYS_FILENAME).write_bytes((d / ARRAYS_FILENAME).read_bytes()[:-10]),
            r"truncated or corrupted: .*buffer\.safetensors",
        ),
        (lambda d: _edit_meta(d, format_version=99), "format version 99.*reads version 1"),
        (lambda d: _edit_meta(d, format="something-else"), "is not an ExGRPO state file"),
    ],
    ids=["no-meta", "no-arrays", "truncated-meta", "truncated-arrays", "version", "format"],
)
def test_bad_state_exits_1_with_the_message(checkpoint, capsys, damage, message):
    damage(checkpoint / STATE_DIRNAME)
    assert cli.main(["inspect", str(checkpoint)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("exgrpo inspect: ")
    assert re.search(message, captured.err), captured.err


def _set(*keys, value):
    """An edit of state.json's JSON setting the field at `keys` (object keys and array indices) to `value`."""

    def edit(meta):
        parent = meta
        for key in keys[:-1]:
            parent = parent[key]
        parent[keys[-1]] = value
        return meta

    return edit


@pytest.mark.parametrize(
    "edit, what",
    [
        (lambda meta: [1, 2, 3], "malformed (it holds an array, expected an object)"),
        (lambda meta: {"format": meta["format"]}, "incomplete (no 'format_version')"),
        (_set("arrays", "lengths", value={"dtype": "int64", "size": 6}), "incomplete (no 'arrays.lengths.crc32')"),
        (
            _set("buffer", "questions", 0, value="q0"),
            "malformed ('buffer.questions[0]' is a string, expected an object)",
        ),
        (
            _set("buffer", "config", "num_generations", value="8"),
            "malformed ('buffer.config.num_generations' is a string, expected an integer)",
        ),
        (_set("trainer", value=[]), "malformed ('trainer' is an array, expected an object)"),
        (
            _set("trainer", "replay_active", value=[True]),
            "malformed ('trainer.replay_active' is an array, expected a boolean)",
        ),
    ],
    ids=["list", "only-format", "no-crc", "question-string", "k-string", "trainer-list", "switch-list"],
)
def test_wrong_shape_state_json_exits_1_naming_the_file(checkpoint, capsys, edit, what):
    """Valid JSON of the wrong shape: one line naming the file and the field (an AttributeError, KeyError or
    TypeError traceback before)."""
    path = checkpoint / STATE_DIRNAME / META_FILENAME
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    assert cli.main(["inspect", str(checkpoint)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"exgrpo inspect: ExGRPO state file is {what}: {path}\n"


@pytest.mark.parametrize("args", [[], ["--json"]], ids=["text", "json"])
def test_closed_pipe_exits_quietly(checkpoint, args):
    """`exgrpo inspect CKPT | head`, the reader gone before the summary is written: no traceback, no "Exception
    ignored ... BrokenPipeError" on stderr; status 1, as Python's own recipe for a closed stdout."""
    command = [sys.executable, "-m", "exgrpo_trl.cli", "inspect", str(checkpoint), *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # at once: the command needs far longer to start than this takes, so it writes to no reader
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 1
    assert err == ""


def test_corrupted_arrays(checkpoint, capsys):
    """The per-trajectory arrays are checked on every run; the token arrays with --verify."""
    state_dir = checkpoint / STATE_DIRNAME
    path = state_dir / ARRAYS_FILENAME
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    offsets = {k: v["data_offsets"] for k, v in json.loads(raw[8 : 8 + header_len]).items() if k != "__metadata__"}
    data_start = 8 + header_len

    def flip(name):
        data = bytearray(path.read_bytes())
        data[data_start + offsets[name][0]] ^= 0xFF  # the first byte of that array
        path.write_bytes(bytes(data))

    flip("completion_ids")
    assert main([str(checkpoint)]) == 0
    capsys.readouterr()
    assert main([str(checkpoint), "--verify"]) == 1
    assert "checksum of 'completion_ids' differs" in capsys.readouterr().err
    flip("completion_ids")  # undo
    flip("collected_at")
    assert main([str(checkpoint)]) == 1
    assert "checksum of 'collected_at' differs" in capsys.readouterr().err


def test_plain_grpo_checkpoint_and_output_folder_hints(tmp_path, checkpoint, capsys):
    plain = tmp_path / "plain" / "checkpoint-3"
    plain.mkdir(parents=True)
    assert main([str(plain)]) == 1
    assert "holds no exgrpo_state/ folder (a plain GRPO checkpoint?)" in capsys.readouterr().err
    assert main([str(checkpoint.parent)]) == 1  # the output folder, not a checkpoint
    assert "its checkpoints: checkpoint-12" in capsys.readouterr().err
    assert main([str(tmp_path / "nowhere")]) == 1
    assert "is not a folder" in capsys.readouterr().err


def test_checkpoint_of_a_real_run_matches_the_trainer(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, train_dataset=synthetic_dataset(n=16, always_every=4), max_steps=3,
                           save_strategy="steps", save_steps=3, replay_start_pass_rate=0.0)  # fmt: skip
    trainer.train()
    buffer = trainer.exgrpo_state.buffer
    s = summarize(tmp_path / "out" / "checkpoint-3", verify=True)
    assert buffer.num_trajectories > 0
    assert (s["questions"], s["trajectories"], s["tokens"], s["retired"]) == (
        buffer.num_questions,
        buffer.num_trajectories,
        buffer.num_tokens,
        len(buffer.retired),
    )
    assert {k: b["questions"] for k, b in s["buckets"].items()} == buffer.bucket_counts()
    assert s["trainer"] == {"replay_active": True, "generation_batches": 3}
    assert s["bytes"]["token_data"] == 6 * buffer.num_tokens


# ------------------------------------------------------------------------------------------------------------------
# The file inspect reads: state.py writes and reads buffer.safetensors itself, one trajectory at a time (no
# whole-buffer copy in memory). It must stay a standard safetensors file and survive short reads and writes.
def _buffer_with(num_questions=6, seed=1):
    rng = np.random.default_rng(seed)
    buffer = ExperienceBuffer(8, seed=seed)
    for q in range(num_questions):
        trajectories = [
            Trajectory(rng.integers(0, 50, size=int(n)), -rng.random(int(n)), collected_at=q)
            for n in rng.integers(1, 12, size=int(rng.integers(1, 4)))
        ]
        buffer.update_group(f"q{q}", int(rng.integers(1, 8)), {"prompt": f"{q}+1="}, trajectories)
    return buffer


def test_state_file_is_standard_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    buffer = _buffer_with()
    save_state(tmp_path, buffer, {})
    path = tmp_path / STATE_DIRNAME / ARRAYS_FILENAME
    expected, _ = buffer.state_dict()
    loaded = load_file(str(path))
    assert loaded.keys() == expected.keys()
    assert all(loaded[k].dtype == expected[k].dtype and np.array_equal(loaded[k], expected[k]) for k in expected)
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "exgrpo-trl-state", "version": "1"}
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert (8 + n) % 8 == 0  # every array starts aligned to its item size
    for name, entry in header.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % np.dtype(expected[name].dtype).itemsize == 0


def test_state_round_trip_with_short_reads_and_writes(tmp_path, monkeypatch):
    import os

    from exgrpo_trl.state_file import load_state, read_meta, verify_arrays

    real_writev, real_preadv = os.writev, os.preadv

    def short_writev(fd, buffers):  # at most 3 bytes per call
        return real_writev(fd, [bytes(memoryview(buffers[0]).cast("B")[:3])])

    def short_preadv(fd, buffers, offset):  # at most 5 bytes per call
        view = memoryview(buffers[0]).cast("B")
        return real_preadv(fd, [view[: min(5, len(view))]], offset)

    buffer = _buffer_with()
    monkeypatch.setattr(os, "writev", short_writev)
    save_state(tmp_path, buffer, {})
    monkeypatch.setattr(os, "preadv", short_preadv)
    restored = ExperienceBuffer(8)
    load_state(tmp_path, restored)
    verify_arrays(tmp_path, read_meta(tmp_path), chunk_bytes=7)
    monkeypatch.undo()
    a, b = buffer.state_dict(), restored.state_dict()
    assert all(np.array_equal(a[0][k], b[0][k]) for k in a[0]) and json.dumps(a[1]) == json.dumps(b[1])


def test_loaded_trajectories_own_their_memory(tmp_path):
    """No trajectory is a view into a shared array: retiring a question after a resume frees its memory."""
    from exgrpo_trl.state_file import load_state

    save_state(tmp_path, _buffer_with(), {})
    restored = ExperienceBuffer(8)
    load_state(tmp_path, restored)
    arrays = [a for t in restored.iter_trajectories() for a in (t.completion_ids, t.logps)]
    assert arrays and all(a.base is None and a.flags.owndata and a.flags.writeable for a in arrays)


def test_empty_buffer(tmp_path, capsys):
    buffer = ExperienceBuffer(8)
    buffer.retire("q")
    save_state(tmp_path, buffer, {"replay_active": False, "generation_batches": 2})
    s = summarize(tmp_path, verify=True)
    assert (s["questions"], s["trajectories"], s["tokens"], s["retired"]) == (0, 0, 0, 1)
    assert s["length"] == {"mean": 0.0, "min": 0, "max": 0} and s["collected_steps"] is None
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stored tokens 0\n" in out and "replay        off (delayed start); 2 generation batches" in out
    pytest.importorskip("matplotlib")
    assert main([str(tmp_path), "--plot", str(tmp_path / "empty.png")]) == 0
    assert (tmp_path / "empty.png").stat().st_size > 1000
