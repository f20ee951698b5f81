"""Run by tests/vllm/test_vllm_server_failure.py (one process, or two under `accelerate launch`), never by pytest:
ExGRPO in server mode against a running `trl vllm-serve`, a checkpoint every --save-steps, resumed from the newest
complete checkpoint in --out when there is one (as `exgrpo train` resumes). The main process prints ``STEP n`` as each
optimizer step ends; a failure of the server ends the process as `exgrpo train` ends, with its one line and exit 1.
EXGRPO_TEST_UNGUARDED=1 leaves TRL's client as TRL builds it (what happened before the guard). The CPU weight-sync
glue of tests/vllm/cpu_weight_sync.py stands in for TRL's NCCL transfer (CPU only)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> int:
    import pytest
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

    from exgrpo_trl.checkpoints import find_resumable_checkpoint
    from exgrpo_trl.vllm_server import VLLMServerError
    from tests.helpers import make_trainer, synthetic_dataset
    from tests.vllm import cpu_weight_sync

    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--request-timeout", type=float, default=20.0)
    args = p.parse_args()
    out = Path(args.out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    world = int(os.environ.get("WORLD_SIZE", "1"))

    class Progress(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            if state.is_world_process_zero:
                print(f"STEP {state.global_step}", flush=True)

    with pytest.MonkeyPatch.context() as mp:
        cpu_weight_sync.install_server_sync(mp, str(out / "weights"))
        if os.environ.get("EXGRPO_TEST_UNGUARDED") == "1":  # to measure TRL's own client, without the guard
            mp.setattr("exgrpo_trl.trainer.guard_client", lambda *args: None)
        trainer = make_trainer(
            out, tokenizer, model=AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32),
            train_dataset=synthetic_dataset(), use_vllm=True, vllm_mode="server", vllm_server_base_url=args.base_url,
            vllm_max_model_length=64, vllm_server_request_timeout=args.request_timeout,
            per_device_train_batch_size=32 // world, num_generations=8, max_completion_length=8,
            max_steps=args.max_steps, replay_start_pass_rate=0.0, save_strategy="steps", save_steps=args.save_steps,
            save_total_limit=100, callbacks=[Progress()],
        )  # fmt: skip
        checkpoint, _ = find_resumable_checkpoint(str(out / "out"))
        try:
            trainer.train(resume_from_checkpoint=checkpoint)
        except VLLMServerError as e:
            print(f"exgrpo train: error: {e}", file=sys.stderr, flush=True)
            return 1
    print(f"DONE {trainer.state.global_step} FROM {checkpoint}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
