"""Figures of one ExGRPO run, from the trainer's `log_history` (and its buffer for the final bucket histogram)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["moving_average", "plot_training", "series"]


def series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for entry in history:
        if key in entry and "step" in entry:
            steps.append(int(entry["step"]))
            values.append(float(entry[key]))
    return steps, values


def moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_training(
    log_history: Sequence[dict[str, Any]],
    buffer: Any = None,
    *,
    smoothing: int | None = None,
    title: str | None = None,
):
    """A 2x2 matplotlib figure of a run's reward and experience dynamics, returned (not shown).

    - reward: the batch's mean reward per logged step (raw and moving average) and ExGRPO's batch Pass@1;
    - buffer: questions and retired questions (left axis), stored trajectories (right axis, dashed);
    - replay: the fraction of each batch's questions replayed from the buffer, and where replay was active;
    - buckets: questions per success count k = 1..K-1 at the end, from `buffer` (an `ExperienceBuffer`) when given,
      else from the last logged ``exgrpo/buffer/bucket_k``.

    `smoothing` is the moving-average window in logged steps (default: a tenth of the run, at least 1).
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    history = list(log_history)
    steps, reward = series(history, "reward")
    window = smoothing or max(1, len(steps) // 10)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))

    ax = axes[0, 0]
    if steps:
        ax.plot(steps, reward, color="tab:red", alpha=0.3, lw=0.8)
        ax.plot(steps, moving_average(reward, window), color="tab:red", lw=2, label=f"reward (mean of {window})")
    pass_steps, pass_at_1 = series(history, "exgrpo/batch/pass_at_1")
    if pass_steps:
        ax.plot(pass_steps, pass_at_1, color="tab:purple", lw=1, ls=":", label="batch Pass@1")
    ax.set(title="training reward", xlabel="optimizer step", ylabel="reward")
    if steps or pass_steps:
        ax.legend(loc="lower right")

    ax = axes[0, 1]
    buffer_steps, questions = series(history, "exgrpo/buffer/questions")
    if buffer_steps:
        ax.plot(buffer_steps, questions, color="tab:red", lw=2, label="buffer questions")
        ax.plot(buffer_steps, series(history, "exgrpo/buffer/retired")[1], color="tab:gray", lw=2, label="retired")
        right = ax.twinx()
        right.plot(buffer_steps, series(history, "exgrpo/buffer/trajectories")[1], color="tab:red", lw=1, ls="--")
        right.set_ylabel("stored trajectories (dashed)")
        ax.legend(loc="upper left")
    ax.set(title="experience buffer", xlabel="optimizer step", ylabel="questions")

    ax = axes[1, 0]
    fraction_steps, fraction = series(history, "exgrpo/replay/fraction")
    active_steps, active = series(history, "exgrpo/replay/active")
    if fraction_steps:
        ax.plot(fraction_steps, fraction, color="tab:blue", lw=2, label="replayed fraction of questions")
    if active_steps:
        ax.fill_between(active_steps, 0, active, step="mid", color="tab:blue", alpha=0.1, label="replay active")
    ax.set(title="replay", xlabel="optimizer step", ylabel="fraction", ylim=(0, 1.05))
    if fraction_steps or active_steps:
        ax.legend(loc="upper left")

    ax = axes[1, 1]
    if buffer is not None:
        buckets = {int(k): int(v) for k, v in buffer.bucket_counts().items()}
    else:
        prefix, last = "exgrpo/buffer/bucket_", {}
        for entry in history:
            last.update({int(k[len(prefix) :]): int(v) for k, v in entry.items() if k.startswith(prefix)})
        buckets = last
    if buckets:
        ks = sorted(buckets)
        ax.bar(ks, [buckets[k] for k in ks], color="tab:red")
        ax.set_xticks(ks)
    ax.set(title="buffer by success count at the end", xlabel="successes k of K", ylabel="questions")

    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
