"""ExGRPO on a vision-language model on one device: replay with images, storage, checkpoints and an exact resume.

A Qwen2-VL-shaped model built locally with random weights (the tests' tiny model, exgrpo_trl/tasks/vision.py, at
the size the flags give) on solid-colour images whose colour is the answer (every prompt's text is the same, so
only the image tells questions apart). ExGRPOTrainer replays from the first generation batch; the script checks
that every replayed group's rows carry their question's image (the row key, which holds the image's pixels, is the
plan's key), saves a checkpoint each generation batch, resumes a second trainer from the last one (the buffer and
its images restored exactly) and replays again after the resume.

    python benchmarks/vlm_smoke.py                     # tiny, on the CPU (the default suite runs this)
    python benchmarks/vlm_smoke.py --device cuda --bf16 --hidden-size 896 --layers 24 --heads 14 --kv-heads 2 \\
        --intermediate-size 4864 --vision-depth 8 --vision-embed 640 --image-size 224 --max-completion-length 64
                                                       # a Qwen2-VL shape of about 0.6B on a GPU (the tiny
                                                       # word-level vocabulary: the logits are narrow)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' tiny VLM builder
sys.path.insert(0, str(Path(__file__).resolve().parent))  # real_vocab's resume check
from real_vocab import buffer_digest, train_from_checkpoint  # noqa: E402

from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer  # noqa: E402
from exgrpo_trl.buffer import image_digest, row_images, row_key  # noqa: E402
from exgrpo_trl.state_file import STATE_DIRNAME  # noqa: E402
from exgrpo_trl.tasks.vision import build_tiny_processor, colour_dataset, colour_reward, save_tiny_vlm  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="train in bfloat16 (the model is saved in it)")
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--intermediate-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--vision-depth", type=int, default=1)
    p.add_argument("--vision-embed", type=int, default=32)
    p.add_argument("--vision-heads", type=int, default=2)
    p.add_argument("--image-size", type=int, default=28, help="pixels a side (28: one image token; 224: 64)")
    p.add_argument("--questions-per-step", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=12)
    p.add_argument("--micro-batch-rows", type=int, default=8)
    p.add_argument("--replay-ratio", type=float, default=0.5)
    p.add_argument("--generation-batches", type=int, default=2, help="before the save; the resumed run adds one")
    p.add_argument("--questions", type=int, default=64, help="rows of the dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="the model folder and checkpoints (default: a temporary one)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    return p.parse_args(argv)


def shapes(args) -> tuple[dict, dict]:
    """The text and vision fields of the model's config (exgrpo_trl/tasks/vision.py's `tiny_vlm_config`)."""
    head_dim = args.hidden_size // args.heads
    pairs = head_dim // 2  # M-RoPE splits the rotary pairs over time, height and width: about 1/4, 3/8, 3/8
    section = [pairs // 4, (pairs - pairs // 4) // 2, pairs - pairs // 4 - (pairs - pairs // 4) // 2]
    text = dict(
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
    )  # fmt: skip
    vision = dict(depth=args.vision_depth, embed_dim=args.vision_embed, num_heads=args.vision_heads)
    return text, vision


def make_trainer(args, model_dir: str, processor, dataset, output_dir: Path) -> ExGRPOTrainer:
    rows, k = args.micro_batch_rows, args.num_generations
    config = ExGRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=rows,
        steps_per_generation=args.questions_per_step * k // rows,  # one generation batch = questions x K rows
        num_generations=k,
        max_completion_length=args.max_completion_length,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        replay_ratio=args.replay_ratio,
        replay_start_pass_rate=0.0,  # replay from the first generation batch
        logging_steps=1,
        report_to=[],
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        save_strategy="no",
        seed=args.seed,
        disable_tqdm=True,
    )
    return ExGRPOTrainer(
        model=model_dir, reward_funcs=colour_reward, args=config, train_dataset=dataset, processing_class=processor
    )


def watch_replays(trainer, k: int) -> dict:
    """Counts, over the generation batches the trainer plans, the replayed groups and the replayed rows whose image
    is missing or whose key (text and pixels) is not the plan's key for their group."""
    seen = {"replayed_groups": [], "replayed_rows": 0, "rows_without_their_image": 0}
    run = trainer.exgrpo_run
    assign = run._rows  # the cycle's own step that gives the rows to replayed questions

    def recorded(inputs, plan):
        result = assign(inputs, plan)
        groups = [] if plan is None else list(plan.group_indices)
        seen["replayed_groups"].append(len(groups))
        for j, group in enumerate(groups):
            for row in result.inputs[group * k : (group + 1) * k]:
                seen["replayed_rows"] += 1
                if row.get("image") is None or row_key(row) != plan.keys[j]:
                    seen["rows_without_their_image"] += 1
        return result

    run._rows = recorded
    return seen


def digest(buffer) -> tuple:
    """Everything the buffer holds, comparable with ==: an image by its pixels (`image_digest`)."""
    return buffer_digest(buffer, default=image_digest)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="exgrpo-vlm-smoke-"))
    text, vision = shapes(args)
    max_pixels = max(56, args.image_size) ** 2
    model_dir = save_tiny_vlm(
        out / "model", seed=args.seed, text=text, vision=vision, dtype=torch.bfloat16 if args.bf16 else None,
        max_pixels=max_pixels,
    )  # fmt: skip
    processor = build_tiny_processor(max_pixels)
    dataset = colour_dataset(args.questions, seed=args.seed + 1, size=args.image_size)
    k, n = args.num_generations, args.generation_batches

    trainer = make_trainer(args, model_dir, processor, dataset, out / "run")
    spg = trainer.args.steps_per_generation
    trainer.args.max_steps, trainer.args.save_strategy, trainer.args.save_steps = n * spg, "steps", spg
    figures = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "params_millions": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1),
        "dtype": "bfloat16" if args.bf16 else "float32",
        "image_tokens": (args.image_size // 28) ** 2,
    }
    print(json.dumps(figures), flush=True)
    before = watch_replays(trainer, k)
    start = time.perf_counter()
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    buffer = trainer.exgrpo_state.buffer
    saved = digest(buffer)
    checkpoint = out / "run" / f"checkpoint-{n * spg}"
    figures["train"] = {
        **before,
        "optimizer_steps": trainer.state.global_step,
        "seconds": round(time.perf_counter() - start, 1),
        "mean_completion_length": round(statistics.mean(lengths), 1) if lengths else None,
        "buffer_questions": buffer.num_questions,
        "buffer_trajectories": buffer.num_trajectories,
        "stored_images": sum(len(row_images(e.row)) for e in buffer.questions.values()),
        "checkpoint_has_buffer": (checkpoint / STATE_DIRNAME).is_dir(),
        "state_bytes": sum(f.stat().st_size for f in (checkpoint / STATE_DIRNAME).iterdir()),
    }
    del trainer
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    resumed = make_trainer(args, model_dir, processor, dataset, out / "run")
    resumed.args.max_steps = (n + 1) * spg
    after = watch_replays(resumed, k)
    restored = train_from_checkpoint(resumed, checkpoint, digest)
    figures["resume"] = {
        **after,
        "resumed_to_step": resumed.state.global_step,
        "buffer_restored_exactly": restored == saved,
        "buffer_trajectories": resumed.exgrpo_state.buffer.num_trajectories,
    }
    print(json.dumps(figures), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    failures = []
    if not sum(figures["train"]["replayed_groups"]) or not sum(figures["resume"]["replayed_groups"]):
        failures.append("no replayed group before or after the resume")
    if figures["train"]["rows_without_their_image"] or figures["resume"]["rows_without_their_image"]:
        failures.append("a replayed row without its question's image")
    if not (figures["train"]["checkpoint_has_buffer"] and figures["resume"]["buffer_restored_exactly"]):
        failures.append("the checkpoint's buffer was not restored exactly")
    for failure in failures:
        print(f"FAILED: {failure}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
