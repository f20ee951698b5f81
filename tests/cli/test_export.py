"""`exgrpo export`, `exgrpo inspect --show` and `initial_experience`: a real run's buffer exported as a dataset, read
back as text, and seeded into a new run (the same buffer with the same tokenizer; with another, offline trajectories).
"""

import json
import logging
import shutil

import numpy as np
import pytest

from exgrpo_trl import cli
from exgrpo_trl.buffer import ExperienceBuffer
from exgrpo_trl.export import (
    COLUMNS,
    EXPORT_META_FILENAME,
    ExportError,
    buffer_dataset,
    read_export_meta,
    tokenizer_fingerprint,
)
from exgrpo_trl.state_file import STATE_DIRNAME, load_state
from tests.helpers import make_trainer, state_of, synthetic_dataset

K = 8


# 16 questions, 4 a step; replay from the first step
SMALL = dict(train_dataset=synthetic_dataset(n=16, always_every=4), replay_start_pass_rate=0.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer):
    """A 3-step run saving checkpoint-3, exported by the command line to a folder and a parquet file."""
    tmp = tmp_path_factory.mktemp("export")
    trainer = make_trainer(tmp, tokenizer, **SMALL, max_steps=3, save_strategy="steps", save_steps=3)
    trainer.train()
    checkpoint = tmp / "out" / "checkpoint-3"
    buffer = ExperienceBuffer(K)
    load_state(checkpoint, buffer)
    out, parquet = tmp / "buffer-3", tmp / "buffer-3.parquet"
    rc = cli.main(["export", str(checkpoint), "--out", str(out), "--parquet", str(parquet)])
    return {"trainer": trainer, "checkpoint": checkpoint, "buffer": buffer, "out": out, "parquet": parquet, "rc": rc}


def _flat(buffer):
    return [(key, entry, t) for key, entry in buffer.questions.items() for t in entry.trajectories]


def test_export_holds_the_buffer(run, tokenizer, capsys):
    from datasets import load_from_disk

    buffer = run["buffer"]
    assert run["rc"] == 0
    assert state_of(buffer) == state_of(run["trainer"].exgrpo_state.buffer)  # the checkpoint is the end of the run
    assert buffer.num_trajectories > 0
    dataset = load_from_disk(str(run["out"]))
    assert len(dataset) == buffer.num_trajectories
    assert dataset.column_names == list(COLUMNS)  # single-turn: no mask, no record
    rows = dataset.to_list()
    for row, (key, entry, t) in zip(rows, _flat(buffer), strict=True):
        assert row["question_key"] == key
        assert json.loads(row["row"]) == entry.row and row["prompt"] == entry.row["prompt"]
        assert row["completion"] == tokenizer.decode(t.completion_ids.tolist(), skip_special_tokens=True)
        assert row["completion_ids"] == t.completion_ids.tolist()
        assert np.array_equal(np.array(row["behaviour_logps"], dtype=np.float16), t.logps)  # float16 exactly
        assert row["behaviour_logps"] == t.logps.astype(np.float32).tolist()
        assert row["num_tokens"] == t.completion_ids.size
        assert (row["collected_at"], row["k"], row["source"]) == (t.collected_at, entry.k, "on_policy")
    assert {row["collected_at"] for row in rows} <= {0, 1, 2}  # collected at steps 0..2 of a 3-step run
    meta = json.loads((run["out"] / EXPORT_META_FILENAME).read_text())
    assert meta == {
        "format": "exgrpo-trl-export",
        "format_version": 1,
        "num_generations": K,
        "tokenizer": {"class": type(tokenizer).__name__, "fingerprint": tokenizer_fingerprint(tokenizer)},
        "questions": buffer.num_questions,
        "trajectories": buffer.num_trajectories,
    }


def test_parquet_loads_the_same_rows(run, tmp_path):
    from datasets import Dataset, load_from_disk

    parquet = Dataset.from_parquet(str(run["parquet"]), cache_dir=str(tmp_path))
    saved = load_from_disk(str(run["out"]))
    assert parquet.features == saved.features
    assert parquet.to_list() == saved.to_list()
    assert read_export_meta(run["parquet"]) == read_export_meta(run["out"])  # the same JSON, in the file's metadata


def test_inspect_show_prints_questions_as_text(run, tokenizer, capsys):
    buffer = run["buffer"]
    checkpoint = str(run["checkpoint"])
    assert cli.main(["inspect", checkpoint]) == 0
    summary = capsys.readouterr().out
    assert cli.main(["inspect", checkpoint, "--show", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(summary)  # the counts first, unchanged
    expected = ["", f"shown         2 of {buffer.num_questions} questions (buffer order)"]
    for i, (key, entry) in enumerate(list(buffer.questions.items())[:2], 1):
        n = len(entry.trajectories)
        expected += ["", f"question {i}  k {entry.k} of {K}, {n} trajector{'y' if n == 1 else 'ies'}  (key {key})"]
        expected += ["  prompt", f"    {entry.row['prompt']}"]
        for j, t in enumerate(entry.trajectories, 1):
            text = tokenizer.decode(t.completion_ids.tolist(), skip_special_tokens=True)
            # its use count, and the advantage TRL gave it when it was collected
            times = "time" if t.uses == 1 else "times"
            extra = f", replayed {t.uses} {times}, advantage {t.advantage:+.4g} when collected"
            expected += [
                f"  trajectory {j}: {t.completion_ids.size} tokens, collected in generation batch {t.collected_at}"
                + extra
            ]
            expected += [f"    {text}" if text else "    (empty)"]
    assert out[len(summary) :].splitlines() == expected
    # --json carries the same questions
    assert cli.main(["inspect", checkpoint, "--show", "1", "--json"]) == 0
    (shown,) = json.loads(capsys.readouterr().out)["shown"]
    key, entry = next(iter(buffer.questions.items()))
    assert (shown["key"], shown["prompt"], shown["k"]) == (key, entry.row["prompt"], entry.k)
    assert [t["num_tokens"] for t in shown["trajectories"]] == [t.completion_ids.size for t in entry.trajectories]


def test_no_tokenizer_is_one_line(run, tmp_path, tokenizer_dir, capsys):
    bare = tmp_path / "checkpoint-3"  # the ExGRPO state without the files TRL saves beside it
    shutil.copytree(run["checkpoint"] / STATE_DIRNAME, bare / STATE_DIRNAME)
    for command in (["inspect", str(bare), "--show", "1"], ["export", str(bare), "--out", str(tmp_path / "x")]):
        assert cli.main(command) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == (
            f"exgrpo {command[0]}: {bare} holds no tokenizer (tokenizer_config.json or tokenizer.json); name the "
            "run's with --tokenizer PATH (its model folder or Hub id)\n"
        )
    assert not (tmp_path / "x").exists()
    # --tokenizer names one: the same rows as with the checkpoint's
    assert cli.main(["export", str(bare), "--out", str(tmp_path / "x"), "--tokenizer", str(tokenizer_dir)]) == 0
    from datasets import load_from_disk

    assert load_from_disk(str(tmp_path / "x")).to_list() == load_from_disk(str(run["out"])).to_list()
    assert cli.main(["inspect", str(bare), "--show", "1", "--tokenizer", str(tokenizer_dir)]) == 0


def test_export_errors_are_one_line(run, tmp_path, capsys):
    plain = tmp_path / "plain" / "checkpoint-3"
    plain.mkdir(parents=True)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    cases = [
        (["export", str(plain), "--out", str(tmp_path / "y")], f"{plain} holds no exgrpo_state/ folder"),
        (["export", str(run["checkpoint"]), "--out", str(taken)], f"{taken} exists and is not an earlier export"),
    ]
    for command, message in cases:
        assert cli.main(command) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and message in captured.err
        assert captured.err.startswith("exgrpo export: ") and captured.err.count("\n") == 1
    assert (taken / "notes.txt").read_text() == "mine"
    # an earlier export is replaced
    again = tmp_path / "again"
    assert cli.main(["export", str(run["checkpoint"]), "--out", str(again)]) == 0
    assert cli.main(["export", str(run["checkpoint"]), "--out", str(again)]) == 0
    buffer = run["buffer"]
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"exgrpo export: {buffer.num_trajectories} trajectories of {buffer.num_questions} questions written to {again}"
    )


def _exported(state):
    """What an export carries of a buffer's state: the arrays (ids, log-probs, lengths) and each question's key, k,
    row and number of trajectories, in buffer order. Not carried, so not compared: the sampler's random generator
    state, the retired set (a fresh run's is empty), each question's position in its bucket, and the stamps: a seeded
    trajectory is put on the new run's clock (collected at 0)."""
    arrays, meta = state
    questions = [{k: q[k] for k in ("key", "k", "row", "num_trajectories")} for q in meta["questions"]]
    return {k: v for k, v in arrays.items() if k != "collected_at"}, questions, meta["config"]


@pytest.mark.parametrize("source", ["out", "parquet"])
def test_seeding_with_the_same_tokenizer_restores_the_buffer(run, tmp_path, tokenizer, caplog, source):
    with caplog.at_level(logging.INFO, logger="exgrpo_trl.trainer"):
        seeded = make_trainer(tmp_path, tokenizer, **SMALL, initial_experience=str(run[source])).exgrpo_state.buffer
    assert _exported(state_of(seeded)) == _exported(state_of(run["buffer"]))
    assert set(state_of(run["buffer"])[0]["collected_at"]) != {0} and set(state_of(seeded)[0]["collected_at"]) == {0}
    assert not seeded.retired
    buffer = run["buffer"]
    messages = [r.getMessage() for r in caplog.records if r.name == "exgrpo_trl.trainer"]
    assert messages == [
        f"ExGRPO: seeded the experience buffer from {run[source]}: {buffer.num_questions} questions, "
        f"{buffer.num_trajectories} trajectories, with their token ids and behaviour log-probs."
    ]


def test_seeding_with_another_tokenizer_retokenizes_as_offline(run, tmp_path, caplog):
    from datasets import load_from_disk

    from exgrpo_trl.tasks.toy import ALPHABET, build_char_tokenizer

    other = build_char_tokenizer(alphabet=ALPHABET + ("x",))
    assert tokenizer_fingerprint(other) != read_export_meta(run["out"])["tokenizer"]["fingerprint"]
    rows = load_from_disk(str(run["out"])).to_list()
    max_length = 4
    expected = {}  # key -> (k, row, the distinct re-tokenized ids that fit, in order)
    too_long = 0
    for row in rows:
        ids = other(row["completion"], add_special_tokens=False)["input_ids"] + [other.eos_token_id]
        k, _, kept = expected.setdefault(row["question_key"], (row["k"], json.loads(row["row"]), []))
        if len(ids) > max_length:
            too_long += 1
        elif ids not in kept:
            kept.append(ids)
    expected = {key: value for key, value in expected.items() if value[2]}
    assert too_long > 0 and expected  # both cases occur

    with caplog.at_level(logging.INFO, logger="exgrpo_trl.trainer"):
        trainer = make_trainer(
            tmp_path, other, **SMALL, initial_experience=str(run["out"]), max_completion_length=max_length
        )
    seeded = trainer.exgrpo_state.buffer
    assert list(seeded.questions) == list(expected)
    for key, entry in seeded.questions.items():
        k, row, kept = expected[key]
        assert (entry.k, entry.row) == (k, row)
        assert [t.completion_ids.tolist() for t in entry.trajectories] == kept
        assert all(t.logps.dtype == np.float16 and not t.logps.any() for t in entry.trajectories)  # log-prob 0
    # put on this run's clock: collected at 0, the batch the run seeds at (the export's stamps are the other run's)
    assert {t.collected_at for e in seeded.questions.values() for t in e.trajectories} == {0}
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "exgrpo_trl.trainer"]
    num = sum(len(kept) for _, _, kept in expected.values())
    assert messages == [
        (
            logging.WARNING,
            f"ExGRPO: initial_experience {run['out']}: left out {too_long} trajectories longer than "
            "max_completion_length.",
        ),
        (
            logging.INFO,
            f"ExGRPO: seeded the experience buffer from {run['out']}: {len(expected)} questions, {num} trajectories, "
            "tokenized again with this run's tokenizer (the export's differs), as offline trajectories.",
        ),
    ]
    # exported again, they say so
    assert set(buffer_dataset(seeded, other, progress=False)["source"]) == {"offline"}


def test_a_resumed_run_takes_the_checkpoints_buffer(run, tmp_path, tokenizer):
    """Seeded at init (a subset: short trajectories only), then resumed from checkpoint-3 (max_steps 3: nothing
    left to train): the checkpoint's buffer, whole."""
    trainer = make_trainer(
        tmp_path, tokenizer, **SMALL, initial_experience=str(run["out"]), max_steps=3, max_completion_length=4
    )
    assert 0 < trainer.exgrpo_state.buffer.num_trajectories < run["buffer"].num_trajectories
    trainer.train(resume_from_checkpoint=str(run["checkpoint"]))
    assert state_of(trainer.exgrpo_state.buffer) == state_of(run["buffer"])


def test_seeding_errors_are_one_line(run, tmp_path, tokenizer):
    cases = [
        (
            {"initial_experience": str(run["out"]), "num_generations": 4},
            f"{run['out']} was exported from a run with num_generations=8, this run uses 4: its success counts do "
            "not carry over. Seed a run with num_generations=8, or export another buffer.",
        ),
        (
            {"initial_experience": str(tmp_path / "nowhere")},
            f"ExGRPO buffer export not found: {tmp_path / 'nowhere'}",
        ),
        (
            {"initial_experience": str(run["checkpoint"])},  # a checkpoint, not an export
            f"{run['checkpoint']} is not an ExGRPO buffer export (no {EXPORT_META_FILENAME})",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ExportError) as error:
            make_trainer(tmp_path, tokenizer, **SMALL, **overrides)
        assert str(error.value) == message


def test_multi_turn_columns_round_trip(tmp_path, tokenizer):
    """A buffer with tool tokens: `mask` and `record` columns, kept by seeding with the same tokenizer; with another,
    such trajectories are left out (which of the re-tokenized tokens would be the model's is unknown)."""
    from datasets import load_from_disk

    from exgrpo_trl.buffer import Trajectory
    from exgrpo_trl.export import export_checkpoint, seed_buffer
    from exgrpo_trl.state_file import save_state

    buffer = ExperienceBuffer(K)
    ids = tokenizer("12=3", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]  # 5 tokens
    tool = Trajectory(ids, -np.linspace(0.5, 1.0, 5), 4, mask=[1, 1, 0, 0, 1], record={"rewards": {"env": 1.0}})
    plain = Trajectory(ids[:2] + [tokenizer.eos_token_id], -np.ones(3), 5)
    buffer.update_group("q0", 3, {"prompt": [{"role": "user", "content": "1+2="}]}, [tool, plain])
    checkpoint = tmp_path / "checkpoint-6"
    save_state(checkpoint, buffer, {})
    out = tmp_path / "export"
    export_checkpoint(checkpoint, out, tokenizer=tokenizer, progress=False)
    rows = load_from_disk(str(out)).to_list()
    assert [(r["mask"], r["record"]) for r in rows] == [([1, 1, 0, 0, 1], '{"rewards": {"env": 1.0}}'), (None, None)]
    assert [r["prompt"] for r in rows] == ['[{"role": "user", "content": "1+2="}]'] * 2
    assert [r["completion"] for r in rows] == ["12=3", "12"]

    def tokenize(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    same = ExperienceBuffer(K)
    report = seed_buffer(same, out, fingerprint=tokenizer_fingerprint(tokenizer), tokenize=tokenize, max_length=12)
    assert (report.questions, report.trajectories, report.multi_turn, report.retokenized) == (1, 2, 0, False)
    # the same generator seed and no retired set: the whole state, but for the stamps (this run's clock: 0)
    seeded_arrays, seeded_meta = state_of(same)
    arrays, meta = state_of(buffer)
    assert seeded_meta == meta and seeded_arrays == {**arrays, "collected_at": [0, 0]}
    assert arrays["collected_at"] == [4, 5]
    other = ExperienceBuffer(K)
    report = seed_buffer(other, out, fingerprint="another", tokenize=tokenize, max_length=12)
    assert (report.questions, report.trajectories, report.multi_turn, report.retokenized) == (1, 1, 1, True)
    (kept,) = other.questions["q0"].trajectories
    assert kept.completion_ids.tolist() == plain.completion_ids.tolist() and not kept.logps.any()
    assert report.skipped() == "1 multi-turn trajectories (another tokenizer: cannot be re-tokenized)"
