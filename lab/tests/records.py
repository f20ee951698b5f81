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


def arm_records(setting, finals_by_arm, seeds, batches_by_arm=None):
    """One record per arm and seed: a two-point curve (warm start 0.2 at 0 rollouts, then the final figure at 1000
    rollouts for GRPO and 950 for the replaying arms), with the arm's generation-batch records."""
    out = []
    for arm, finals in finals_by_arm.items():
        for seed, final in zip(seeds, finals):
            rollouts = 1000 if arm == "grpo" else 950
            record = make_record(setting, arm, seed, [0, 100], [0, rollouts], [0.2, final])
            record["batches"] = (batches_by_arm or {}).get(arm, [])
            out.append(record)
    return out
