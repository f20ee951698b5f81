"""`exgrpo demo`: ExGRPO vs GRPO side by side on a toy verifiable task, on a CPU, in minutes.

Phases (each with a progress bar):
1. warm start: a ~1M-parameter Qwen2-shaped model and a char tokenizer, built locally, trained with a short
   supervised phase on integer addition (1-4 digits, difficulty = digits); cached on disk (`--cache-dir`);
2. held-out evaluation of the warm start (sampled pass@1, several samples per question, by difficulty);
3. TRL's `GRPOTrainer` from the warm start;
4. `ExGRPOTrainer` from the same warm start, same seed, same batch shape and hyperparameters apart from
   ExGRPO's own;
5. held-out evaluation of both.

Output: a table on stdout, `OUT/results.json` and `OUT/figure.png` (reward curves, buffer and retired-set sizes
over training, the final bucket histogram, pass@1 by difficulty).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

from ..utils.plotting import moving_average, series

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULTS = dict(
    steps=300,
    warm_start_steps=1500,
    warm_start_seed=0,
    data_seed=0,
    train_questions=2000,
    eval_questions=200,
    eval_samples=16,
    prompts_per_step=16,
    num_generations=8,
    learning_rate=1e-4,
)
# The demo's model: Qwen2-shaped, ~1.05M parameters. Four heads of 32 (a head size vLLM's CPU backend also
# supports): with two heads of 64 the supervised warm start stalls on multi-digit sums for longer.
MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512)
QUICK = dict(steps=2, warm_start_steps=5, train_questions=64, eval_questions=8, eval_samples=2)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="exgrpo demo",
        description="ExGRPO vs GRPO side by side on a toy verifiable task (integer addition, 1-4 digits), on a "
        "CPU, in minutes. Writes OUT/results.json and OUT/figure.png and prints a table.",
    )
    p.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    p.add_argument("--seed", type=int, default=0, help="seed of both RL runs and of the evaluation sampling")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps per RL run (default {DEFAULTS['steps']})")
    p.add_argument(
        "--warm-start-steps",
        type=int,
        default=None,
        help=f"supervised warm-start steps (default {DEFAULTS['warm_start_steps']}; cached)",
    )
    p.add_argument("--warm-start-seed", type=int, default=None, help="seed of the warm start (default 0)")
    p.add_argument("--data-seed", type=int, default=None, help="seed of the train/eval question split (default 0)")
    p.add_argument("--cache-dir", default=".cache/exgrpo-demo", help="warm-start cache (default: .cache/exgrpo-demo)")
    p.add_argument("--train-questions", type=int, default=None, help="RL training questions (default 2000)")
    p.add_argument("--eval-questions", type=int, default=None, help="held-out questions (default 200)")
    p.add_argument("--eval-samples", type=int, default=None, help="samples per held-out question (default 16)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="questions per step (default 16)")
    p.add_argument("--num-generations", type=int, default=None, help="rollouts per question K (default 8)")
    p.add_argument("--learning-rate", type=float, default=None, help="RL learning rate (default 1e-4)")
    p.add_argument("--replay-ratio", type=float, default=None, help="ExGRPO rho (default: ExGRPOConfig's, 0.5)")
    p.add_argument(
        "--replay-start-pass-rate",
        type=float,
        default=None,
        help="ExGRPO delayed-start threshold (default: ExGRPOConfig's, 0.35)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run in seconds: " + ", ".join(f"{k.replace('_', '-')}={v}" for k, v in QUICK.items()),
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1; at this model size more threads gain little, and any other busy "
        "process on the machine makes multi-threaded steps many times slower)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _resolve(args: argparse.Namespace) -> dict:
    settings = dict(DEFAULTS)
    settings.update(warm_start_seed=0, data_seed=0)
    if args.quick:
        settings.update(QUICK)
    for key in list(settings):
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    settings.update(
        threads=args.threads or 1,
        seed=args.seed,
        out=str(args.out),
        cache_dir=str(args.cache_dir),
        replay_ratio=args.replay_ratio,
        replay_start_pass_rate=args.replay_start_pass_rate,
    )
    return settings


# ------------------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def _quiet():
    """Silence library warnings and info logs for a clean demo output (errors still show)."""
    import datasets
    import transformers

    t_level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    t_bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" etc.
    ds_logger = logging.getLogger("DeepSpeed")  # "Setting accelerator to CPU" when deepspeed is installed
    ds_level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)
    d_bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    exgrpo_logger = logging.getLogger("exgrpo_trl")
    e_level = exgrpo_logger.level
    exgrpo_logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(t_level)
        if t_bars:
            transformers.utils.logging.enable_progress_bar()
        ds_logger.setLevel(ds_level)
        if d_bars:
            datasets.utils.logging.enable_progress_bar()
        exgrpo_logger.setLevel(e_level)


def _progress_callback(desc: str, enabled: bool):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class _Bar(TrainerCallback):
        """One tqdm bar per training run, with the mean reward of the last step (replaces TRL's log printing)."""

        bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=state.max_steps, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is not None and logs and "reward" in logs:
                post = {"reward": f"{logs['reward']:.3f}"}
                if "exgrpo/buffer/questions" in logs:
                    post["buffer"] = int(logs["exgrpo/buffer/questions"])
                    post["retired"] = int(logs.get("exgrpo/buffer/retired", 0))
                self.bar.set_postfix(post)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return _Bar()


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _fmt(x) -> str:
    return "  -  " if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


# ------------------------------------------------------------------------------------------ training
def _common_config(settings: dict, output_dir: str) -> dict:
    return dict(
        output_dir=output_dir,
        max_steps=settings["steps"],
        per_device_train_batch_size=settings["prompts_per_step"] * settings["num_generations"],
        num_generations=settings["num_generations"],
        max_completion_length=8,
        temperature=1.0,
        learning_rate=settings["learning_rate"],
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        seed=settings["seed"],
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=False,
    )


def _train(kind: str, model, tokenizer, train_set, settings: dict, progress: bool) -> dict:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ..tasks.toy import addition_reward

    output_dir = str(Path(settings["out"]) / "trainer" / kind)
    common = _common_config(settings, output_dir)
    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        config, trainer_cls, desc = GRPOConfig(**common), GRPOTrainer, "GRPO   (TRL GRPOTrainer)"
    else:
        from ..config import ExGRPOConfig
        from ..trainer import ExGRPOTrainer

        extra = {}
        if settings["replay_ratio"] is not None:
            extra["replay_ratio"] = settings["replay_ratio"]
        if settings["replay_start_pass_rate"] is not None:
            extra["replay_start_pass_rate"] = settings["replay_start_pass_rate"]
        config, trainer_cls, desc = ExGRPOConfig(**common, **extra), ExGRPOTrainer, "ExGRPO (ExGRPOTrainer)"
    trainer = trainer_cls(
        model=model,
        reward_funcs=[addition_reward],
        args=config,
        train_dataset=train_set,
        processing_class=tokenizer,
    )
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_progress_callback(desc, progress))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    result = {"trainer": trainer, "seconds": seconds, "history": list(trainer.state.log_history), "config": config}
    return result


def _exgrpo_summary(trainer, history: list[dict], num_generations: int) -> dict:
    """Final buffer statistics, from the trainer's buffer when it has one, else from the logged metrics."""
    last = {}
    for entry in history:
        last.update({k: v for k, v in entry.items() if k.startswith("exgrpo/")})
    buffer = getattr(trainer, "experience_buffer", None)
    if buffer is not None:
        buckets = {int(k): int(v) for k, v in buffer.bucket_counts().items()}
        questions, trajectories, retired = buffer.num_questions, buffer.num_trajectories, len(buffer.retired)
    else:
        buckets = {k: int(last.get(f"exgrpo/buffer/bucket_{k}", 0)) for k in range(1, num_generations)}
        questions = int(last.get("exgrpo/buffer/questions", 0))
        trajectories = int(last.get("exgrpo/buffer/trajectories", 0))
        retired = int(last.get("exgrpo/buffer/retired", 0))
    for k in range(1, num_generations):
        buckets.setdefault(k, 0)
    active_steps, active = series(history, "exgrpo/replay/active")
    start_step = next((s for s, a in zip(active_steps, active) if a > 0), None)
    fraction_steps, fraction = series(history, "exgrpo/replay/fraction")
    after = [f for s, f in zip(fraction_steps, fraction) if start_step is not None and s > start_step]
    return {
        "buffer_questions": questions,
        "buffer_trajectories": trajectories,
        "retired": retired,
        "replayed_fraction": _mean(fraction),
        "replayed_fraction_after_start": _mean(after),
        "replay_start_step": start_step,
        "bucket_counts": dict(sorted(buckets.items())),
    }


# ------------------------------------------------------------------------------------------ report
def _table(evals: dict, timings: dict, exgrpo: dict | None, digits: list[int]) -> str:
    names = [("warm_start", "warm start"), ("grpo", "GRPO"), ("exgrpo", "ExGRPO")]
    lines = [f"{'held-out pass@1':<18}" + "".join(f"{label:>12}" for _, label in names)]
    lines.append("-" * len(lines[0]))
    for d in digits:
        label = f"{d} digit" + ("s" if d > 1 else "")
        row = [evals[k]["by_digits"].get(d) if k in evals else None for k, _ in names]
        lines.append(f"{label:<18}" + "".join(f"{_fmt(v):>12}" for v in row))
    overall = [evals[k]["overall"] if k in evals else None for k, _ in names]
    lines.append(f"{'overall':<18}" + "".join(f"{_fmt(v):>12}" for v in overall))
    train_s = ["", f"{timings.get('grpo_train_s', 0):.0f}s", f"{timings.get('exgrpo_train_s', 0):.0f}s"]
    lines.append(f"{'training time':<18}" + "".join(f"{t:>12}" for t in train_s))
    if exgrpo is not None:
        start = exgrpo["replay_start_step"]
        frac = exgrpo["replayed_fraction"]
        lines.append("")
        lines.append(
            f"ExGRPO at the end: buffer {exgrpo['buffer_questions']} questions / {exgrpo['buffer_trajectories']} "
            f"trajectories, {exgrpo['retired']} retired questions, replayed fraction "
            f"{_fmt(frac)} of questions per batch"
            + (f" (replay on after step {start})" if start is not None else " (replay never switched on)")
        )
        lines.append(
            "buckets (successes k of K): " + ", ".join(f"{k}: {v}" for k, v in exgrpo["bucket_counts"].items())
        )
    return "\n".join(lines)


def _figure(path: Path, results: dict, smoothing: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = results["curves"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax = axes[0, 0]
    for kind, label, color in (("grpo", "GRPO", "tab:blue"), ("exgrpo", "ExGRPO", "tab:red")):
        c = curves.get(kind, {})
        if c.get("step"):
            ax.plot(c["step"], c["reward"], color=color, alpha=0.2, lw=0.8)
            ax.plot(c["step"], moving_average(c["reward"], smoothing), color=color, lw=2, label=label)
    threshold = (results.get("settings", {}).get("exgrpo_settings") or {}).get("replay_start_pass_rate")
    if threshold:
        ax.axhline(threshold, color="k", ls=":", lw=1, label=f"ExGRPO delayed-start threshold ({threshold:g})")
    ax.set(title="training reward (= batch pass@1: binary reward)", xlabel="optimizer step", ylabel="reward")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")

    ax = axes[0, 1]
    ex = curves.get("exgrpo", {})
    if ex.get("buffer_step"):
        ax.plot(ex["buffer_step"], ex["buffer_questions"], color="tab:red", lw=2, label="buffer (questions)")
        ax.plot(ex["buffer_step"], ex["retired"], color="tab:gray", lw=2, label="retired set (questions)")
        ax2 = ax.twinx()
        ax2.plot(ex["buffer_step"], ex["buffer_trajectories"], color="tab:red", lw=1, ls="--")
        ax2.set_ylabel("stored trajectories (dashed)")
        ax2.set_ylim(bottom=0)
        ax.legend(loc="upper left")
    else:
        ax.text(0.5, 0.5, "no buffer metrics logged", ha="center", va="center", transform=ax.transAxes)
    start = results["exgrpo"].get("replay_start_step") if results.get("exgrpo") else None
    if start is not None:
        ax.axvline(start, color="k", ls=":", lw=1)
        ax.annotate(" replay on", (start, 0), xytext=(2, 4), textcoords="offset points", fontsize=9)
    else:
        ax.text(
            0.5,
            0.6,
            "replay never switched on\n(no training batch reached the delayed-start pass rate)",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=10,
        )
    ax.set(title="ExGRPO experience: buffer and retired set", xlabel="optimizer step", ylabel="questions")
    ax.set_ylim(bottom=0)

    ax = axes[1, 0]
    buckets = results.get("exgrpo", {}).get("bucket_counts", {})
    ks = sorted(int(k) for k in buckets)
    ax.bar(ks, [buckets[k] if k in buckets else buckets[str(k)] for k in ks], color="tab:red")
    k_total = results["settings"]["num_generations"]
    ax.set_xticks(ks, [f"{k}/{k_total}" for k in ks])
    if not any(buckets.values()):
        ax.text(0.5, 0.5, "buffer empty", ha="center", va="center", transform=ax.transAxes, fontsize=11)
    ax.set(
        title="ExGRPO buffer at the end: questions per bucket",
        xlabel="successes in the latest group",
        ylabel="questions",
    )
    ax.set_ylim(bottom=0)

    ax = axes[1, 1]
    evals = results["pass_at_1"]
    digits = sorted({int(d) for e in evals.values() for d in e["by_digits"]})
    width = 0.27
    for i, (kind, label, color) in enumerate(
        (("warm_start", "warm start", "tab:gray"), ("grpo", "GRPO", "tab:blue"), ("exgrpo", "ExGRPO", "tab:red"))
    ):
        if kind in evals:
            by = {int(d): v for d, v in evals[kind]["by_digits"].items()}
            xs = list(range(len(digits))) + [len(digits)]
            ys = [by.get(d, 0.0) for d in digits] + [evals[kind]["overall"]]
            ax.bar([x + (i - 1) * width for x in xs], ys, width, label=label, color=color)
    ax.set_xticks(range(len(digits) + 1), [f"{d} digit{'s' if d > 1 else ''}" for d in digits] + ["overall"])
    s = results["settings"]
    ax.set(
        title=f"held-out pass@1 ({s['eval_questions']} questions x {s['eval_samples']} samples, T=1.0)",
        ylabel="pass@1",
        ylim=(0, 1),
    )
    ax.legend(loc="upper right")
    fig.suptitle(
        f"ExGRPO vs GRPO on 1-4 digit addition (tiny Qwen2, {s['steps']} steps, seed {s['seed']})", fontsize=13
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = _resolve(args)
    progress = not args.no_progress
    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)

    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(settings["threads"])
    try:
        return _run(settings, progress, out)
    finally:
        torch.set_num_threads(threads_before)


def _run(settings: dict, progress: bool, out: Path) -> int:
    import torch

    t_total = time.perf_counter()
    with _quiet():
        from ..tasks.toy import addition_splits, evaluate_pass_at_1, load_or_train_warm_start, warm_start_is_cached

        timings: dict[str, float] = {}
        print(
            f"exgrpo demo: seed {settings['seed']}, {settings['steps']} steps per run, "
            f"{settings['prompts_per_step']} questions x {settings['num_generations']} rollouts per step, "
            f"{torch.get_num_threads()} CPU threads",
            flush=True,
        )
        # 1. warm start (cached)
        ws_kwargs = dict(steps=settings["warm_start_steps"], seed=settings["warm_start_seed"], **MODEL)
        cached = warm_start_is_cached(settings["cache_dir"], **ws_kwargs)
        t = time.perf_counter()
        model, tokenizer = load_or_train_warm_start(settings["cache_dir"], progress=progress, **ws_kwargs)
        timings["warm_start_s"] = time.perf_counter() - t
        print(
            f"warm start: {'loaded from cache' if cached else 'trained'} {model.warm_start_path} "
            f"({timings['warm_start_s']:.0f}s)",
            flush=True,
        )
        n_params = sum(p.numel() for p in model.parameters())
        train_set, eval_set = addition_splits(
            settings["train_questions"], settings["eval_questions"], seed=settings["data_seed"]
        )
        eval_kwargs = dict(samples=settings["eval_samples"], seed=settings["seed"], progress=progress)

        # 2. evaluate the warm start
        evals, per_question = {}, {}
        t = time.perf_counter()
        evals["warm_start"] = evaluate_pass_at_1(model, tokenizer, eval_set, **eval_kwargs)
        timings["eval_s"] = time.perf_counter() - t

        # 3-4. GRPO, then ExGRPO, from the same warm start
        runs = {}
        for kind in ("grpo", "exgrpo"):
            run = _train(kind, copy.deepcopy(model), tokenizer, train_set, settings, progress)
            runs[kind] = run
            timings[f"{kind}_train_s"] = run["seconds"]
            t = time.perf_counter()
            evals[kind] = evaluate_pass_at_1(run["trainer"].model, tokenizer, eval_set, **eval_kwargs)
            timings["eval_s"] += time.perf_counter() - t

    for kind, e in evals.items():
        per_question[kind] = e.pop("per_question")
    exgrpo = _exgrpo_summary(runs["exgrpo"]["trainer"], runs["exgrpo"]["history"], settings["num_generations"])
    curves = {}
    for kind, run in runs.items():
        steps, reward = series(run["history"], "reward")
        _, zero_std = series(run["history"], "frac_reward_zero_std")
        curves[kind] = {"step": steps, "reward": reward, "frac_reward_zero_std": zero_std}
    hist = runs["exgrpo"]["history"]
    b_steps, b_questions = series(hist, "exgrpo/buffer/questions")
    curves["exgrpo"].update(
        buffer_step=b_steps,
        buffer_questions=b_questions,
        buffer_trajectories=series(hist, "exgrpo/buffer/trajectories")[1],
        retired=series(hist, "exgrpo/buffer/retired")[1],
        replay_fraction=series(hist, "exgrpo/replay/fraction")[1],
    )
    timings["total_s"] = time.perf_counter() - t_total
    digits = sorted({d for e in evals.values() for d in e["by_digits"]})
    exgrpo_cfg = runs["exgrpo"]["config"]
    results = {
        "settings": {
            **settings,
            "model": dict(MODEL),
            "model_parameters": n_params,
            "warm_start_cached": cached,
            "warm_start_path": model.warm_start_path,
            "trainer_settings": {
                k: v
                for k, v in _common_config(settings, "").items()
                if k not in ("output_dir", "report_to", "disable_tqdm", "dataloader_num_workers")
            },
            "exgrpo_settings": {
                k: getattr(exgrpo_cfg, k, None)
                for k in (
                    "replay_ratio",
                    "replay_start_pass_rate",
                    "replay_mu",
                    "replay_sigma",
                    "question_selection",
                    "trajectory_selection",
                    "policy_shaping_gamma",
                    "replay_importance_correction",
                    "success_reward_threshold",
                    "skip_retired_questions",
                )
            },
            "platform": {"python": platform.python_version(), "threads": torch.get_num_threads()},
        },
        "timings": timings,
        "pass_at_1": {
            k: {"overall": e["overall"], "by_digits": {str(d): v for d, v in e["by_digits"].items()}}
            for k, e in evals.items()
        },
        "per_question_pass_rate": {
            "prompt": list(eval_set["prompt"]),
            "digits": list(eval_set["digits"]),
            **per_question,
        },
        "exgrpo": {**exgrpo, "bucket_counts": {str(k): v for k, v in exgrpo["bucket_counts"].items()}},
        "curves": curves,
        "figure": "figure.png",
    }
    results_path, figure_path = out / "results.json", out / "figure.png"
    with _quiet():
        _figure(figure_path, {**results, "exgrpo": exgrpo}, smoothing=max(1, settings["steps"] // 20))
    results_path.write_text(json.dumps(results, indent=2) + "\n")

    print()
    print(_table(evals, timings, exgrpo, digits))
    print()
    print(
        f"time: warm start {timings['warm_start_s']:.0f}s{' (cached)' if cached else ''}, "
        f"GRPO {timings['grpo_train_s']:.0f}s, ExGRPO {timings['exgrpo_train_s']:.0f}s, "
        f"evaluation {timings['eval_s']:.0f}s, total {timings['total_s']:.0f}s"
    )
    print(f"results: {results_path}\nfigure:  {figure_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
