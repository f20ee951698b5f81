"""A process that runs `exgrpo train` and kills itself with SIGKILL at a chosen point of writing a checkpoint, and
the environment such processes run in (shared by the crash and kill-resume tests)."""

import os

from tests.helpers import ROOT

ENV = {
    **os.environ,
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
}

# Runs `exgrpo train ARGS` in this process and kills it with SIGKILL at POINT of writing checkpoint-STEP. The save
# itself is the real one; the wrappers only pick the moment, between two of its writes.
CRASH_AT = """
import os, signal, sys
from pathlib import Path

point, target, args = sys.argv[1], "checkpoint-" + sys.argv[2], sys.argv[3:]


def die():
    os.kill(os.getpid(), signal.SIGKILL)


import exgrpo_trl.state_file as state
from transformers.trainer_callback import TrainerState

from exgrpo_trl import ExGRPOTrainer
from exgrpo_trl.cli import main

if point == "exgrpo_state":  # the buffer written into the temporary folder, state.json not yet
    write_arrays = state._write_arrays

    def _write_arrays(path, trajectories, *images):
        entries = write_arrays(path, trajectories, *images)
        if path.parent.parent.name == target:
            die()
        return entries

    state._write_arrays = _write_arrays
elif point == "model":  # exgrpo_state/ in place, nothing else
    save_model = ExGRPOTrainer.save_model

    def _save_model(self, output_dir=None, _internal_call=False):
        if output_dir is not None and Path(output_dir).name == target:
            die()
        return save_model(self, output_dir, _internal_call)

    ExGRPOTrainer.save_model = _save_model
elif point == "optimizer":  # the model saved, the optimizer not
    save_optimizer = ExGRPOTrainer._save_optimizer_and_scheduler

    def _save_optimizer(self, output_dir):
        if Path(output_dir).name == target:
            die()
        return save_optimizer(self, output_dir)

    ExGRPOTrainer._save_optimizer_and_scheduler = _save_optimizer
elif point == "trainer_state":  # everything but the end of trainer_state.json, written last
    save_to_json = TrainerState.save_to_json

    def _save_to_json(self, json_path):
        save_to_json(self, json_path)
        if Path(json_path).parent.name == target:
            os.truncate(json_path, os.path.getsize(json_path) // 2)
            die()

    TrainerState.save_to_json = _save_to_json
elif point == "rotation":  # rotation, after checkpoint-STEP is saved, deletes half of an old checkpoint, then dies
    import shutil
    import types

    import exgrpo_trl.checkpoints as checkpoints

    def _rmtree(path, ignore_errors=False):
        path = Path(path)
        if path.name.startswith("checkpoint-") and (path.parent / target / "trainer_state.json").exists():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            for file in files[: len(files) // 2]:
                file.unlink()
            die()
        return shutil.rmtree(path, ignore_errors=ignore_errors)

    checkpoints.shutil = types.SimpleNamespace(rmtree=_rmtree)
elif point == "final":  # training done, every checkpoint saved; killed in the end-of-run save of the model
    save_model = ExGRPOTrainer.save_model

    def _save_model(self, output_dir=None, _internal_call=False):
        if output_dir is not None and Path(output_dir).resolve() == Path(self.args.output_dir).resolve():
            die()
        return save_model(self, output_dir, _internal_call)

    ExGRPOTrainer.save_model = _save_model
sys.exit(main(["train", *args]))
"""
