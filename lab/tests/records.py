"""Hand-made study run records, with the fields the report reads."""


def make_record(task, arm, seed, eval_steps, rollouts, curve, lr=1e-4, **extra):
    return {
        "task": task, "arm": arm, "seed": seed,
        "settings": {"task": {"learning_rate": lr, "prompts_per_step": 64, "steps_per_generation": 2,
                              "steps": eval_steps[-1], "train_questions": 1000}},
        "curve": {"step": eval_steps, "rollouts": rollouts, "pass_at_1": curve},
        "final": {"pass_at_1": curve[-1], "rollouts": rollouts[-1], **extra.pop("final", {})},
        **extra,
    }  # fmt: skip
