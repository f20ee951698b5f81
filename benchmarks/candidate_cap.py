"""What `max_trajectory_candidates` changes: how often a shortlist of M still holds the lowest-entropy trajectory.

ExGRPO (§6) scores every stored trajectory of a replayed question under the current policy and picks the argmin
of the mean per-token entropy. With `max_trajectory_candidates=M`, only a shortlist of M is scored: the library's rule
takes the M with the lowest stored NLL (`exgrpo_trl.buffer.shortlist_indices`); the M most recently stored are shown
beside it for comparison. This script trains ExGRPOTrainer *uncapped* (the paper's selection drives training) on the
synthetic task of `benchmarks/overhead.py`, and at every replay selection also works out which trajectory each cap
would have picked, from the same entropies. It prints, per M: how often the pick is the same, the mean and largest
entropy gap (capped pick - true minimum) when it is not, and the share of scoring rows the cap saves.

    python benchmarks/candidate_cap.py                  # 120 steps, learning rate 1e-5 (as overhead.py), caps 2 4 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import add_task_arguments, build_model, build_task, prefill  # noqa: E402

from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer  # noqa: E402
from exgrpo_trl import draw as draw_module  # noqa: E402
from exgrpo_trl.buffer import shortlist_indices  # noqa: E402

CHOOSE_QUESTIONS = draw_module.choose_questions


class RecordingExGRPOTrainer(ExGRPOTrainer):
    """Records, for every scored question, its candidates' entropies (oldest stored first). Single process only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.selections: list[np.ndarray] = []
        self.stored_nll: list[np.ndarray] = []
        self._sampled: list[str] = []
        choose = CHOOSE_QUESTIONS

        def recording_choose(buffer, n, clock):
            self._sampled = choose(buffer, n, clock)
            return self._sampled

        draw_module.choose_questions = recording_choose  # the draw looks it up at each call

    def _exgrpo_score_entropies(self, prompt_ids, completion_ids, masks=None, vision=None):
        entropies = super()._exgrpo_score_entropies(prompt_ids, completion_ids, masks, vision).numpy()
        stored = [self.exgrpo_state.buffer.questions[k].trajectories for k in self._sampled]
        stored = [t for t in stored if len(t) > 1]  # the plan scores only questions with more than one candidate
        counts = [len(t) for t in stored]
        if sum(counts) != len(entropies):
            raise RuntimeError(f"{len(entropies)} scores for {sum(counts)} candidates")
        start = 0
        for n, trajs in zip(counts, stored):
            self.selections.append(entropies[start : start + n].copy())
            self.stored_nll.append(np.array([t.stored_nll() for t in trajs]))
            start += n
        return torch.from_numpy(entropies)


def summarise(selections: list[np.ndarray], stored_nll: list[np.ndarray], caps: list[int]) -> list[str]:
    """Per cap M and rule ("newest": the M most recently stored; "lowest stored NLL": the M with the lowest mean
    -log-prob under the policy that generated them, from the buffer, no forward pass), how often the capped pick is
    the uncapped one."""
    lines = []
    total = sum(len(s) for s in selections)
    age = Counter(len(s) - 1 - int(np.argmin(s)) for s in selections)  # 0: the newest trajectory is the argmin
    lines.append(
        f"{len(selections)} scored selections, {total} candidates scored (mean {total / len(selections):.1f}, "
        f"max {max(len(s) for s in selections)} per question); mean selected entropy "
        f"{np.mean([s.min() for s in selections]):.4f} nats"
    )
    newest = ", ".join(f"{a}: {age[a] / len(selections):.1%}" for a in sorted(age)[:8])
    lines.append(f"age rank of the true argmin (0 = newest stored): {newest}")
    rules = {
        "newest": lambda s, nll, m: np.arange(len(s))[-m:],
        "lowest stored NLL": lambda s, nll, m: np.array(shortlist_indices(nll, m)),  # the library's rule
    }
    for m in caps:
        for rule, pick in rules.items():
            same, gaps, scored = 0, [], 0
            for s, nll in zip(selections, stored_nll):
                kept = pick(s, nll, m)
                scored += len(kept) if len(kept) > 1 else 0
                if kept[int(np.argmin(s[kept]))] == int(np.argmin(s)):
                    same += 1
                else:
                    gaps.append(float(s[kept].min() - s.min()))
            gap_text = f"gap when not: mean {np.mean(gaps):.4f}, max {max(gaps):.4f} nats" if gaps else "never differs"
            lines.append(
                f"M={m} {rule:>17}: same pick {same / len(selections):6.1%} ({same}/{len(selections)}); "
                f"{gap_text}; scores {scored / total:.1%} of the rows"
            )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--caps", type=int, nargs="+", default=[2, 4, 8])
    add_task_arguments(p)
    args = p.parse_args(argv)

    tokenizer, reward, dataset = build_task(args)
    trainer = RecordingExGRPOTrainer(
        model=build_model(tokenizer, args),
        reward_funcs=reward,
        train_dataset=dataset,
        processing_class=tokenizer,
        args=ExGRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="exgrpo-cap-"),
            max_steps=args.steps,
            per_device_train_batch_size=args.questions_per_step * args.num_generations,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            learning_rate=args.learning_rate,
            lr_scheduler_type="constant",
            logging_steps=10,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=args.seed,
            loss_type="dr_grpo",
            scale_rewards="none",
            replay_ratio=args.replay_ratio,
            replay_start_pass_rate=0.0,
            disable_tqdm=True,
            max_trajectory_candidates=None,  # the paper's selection drives training; the caps are counterfactual
        ),
    )
    prefill(trainer, dataset, reward, args)
    try:
        trainer.train()
    finally:
        draw_module.choose_questions = CHOOSE_QUESTIONS  # the recording wrapper off again
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print(f"reward (mean per logged step): first {rewards[0]:.3f}, last {rewards[-1]:.3f}")
    for line in summarise(trainer.selections, trainer.stored_nll, args.caps):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
