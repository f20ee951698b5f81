"""ExGRPOConfig: the paper's defaults and clear errors for bad values."""

import pytest

from exgrpo_trl import ExGRPOConfig


def make(tmp_path, **kwargs):
    return ExGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        num_generations=8,
        per_device_train_batch_size=8,
        **kwargs,
    )


def test_defaults_are_the_papers(tmp_path):
    cfg = make(tmp_path)
    assert (cfg.replay_ratio, cfg.replay_start_pass_rate, cfg.replay_mu, cfg.replay_sigma) == (0.5, 0.35, 0.5, 1.0)
    assert (cfg.question_selection, cfg.trajectory_selection) == ("gaussian", "lowest_entropy")
    assert (cfg.policy_shaping_gamma, cfg.replay_importance_correction) == (0.1, True)
    assert (cfg.success_reward_threshold, cfg.skip_retired_questions) == (1.0, True)
    # the one default that is not the paper's (README, "Decisions"): scoring is bounded to 4 shortlisted candidates
    assert cfg.max_trajectory_candidates == 4
    assert cfg.replay_cooldown == 0  # no reuse limit: the paper's ExGRPO
    # the literature's replay rules, each off: no age limit, no use cap, ExGRPO's Gaussian
    assert (cfg.replay_max_age, cfg.replay_max_uses, cfg.replay_priority) == (None, None, "gaussian")


def test_every_field_has_help():
    from dataclasses import fields

    from trl import GRPOConfig

    own = {f.name for f in fields(ExGRPOConfig)} - {f.name for f in fields(GRPOConfig)}
    assert own == {
        "replay_ratio",
        "replay_start_pass_rate",
        "replay_mu",
        "replay_sigma",
        "replay_cooldown",
        "replay_max_age",
        "replay_max_uses",
        "replay_priority",
        "question_selection",
        "trajectory_selection",
        "policy_shaping_gamma",
        "replay_importance_correction",
        "success_reward_threshold",
        "skip_retired_questions",
        "max_trajectory_candidates",
        "skip_retired_without_replay",
        "replay_stored_trajectory",
        "remove_clip_after_replay_start",
        "offline_solutions_column",
        "offline_guidance",
        "initial_experience",
        "vllm_server_request_timeout",
    }
    for f in fields(ExGRPOConfig):
        if f.name in own:
            assert len(f.metadata.get("help", "")) > 20, f.name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"replay_ratio": 1.5}, r"replay_ratio must be in \[0, 1\]"),
        ({"replay_ratio": -0.1}, r"replay_ratio must be in \[0, 1\]"),
        ({"policy_shaping_gamma": 0.0}, "policy_shaping_gamma must be > 0"),
        ({"policy_shaping_gamma": -1.0}, "policy_shaping_gamma must be > 0"),
        ({"replay_sigma": 0.0}, "replay_sigma must be > 0"),
        ({"replay_mu": 1.2}, r"replay_mu must be in \[0, 1\]"),
        ({"replay_start_pass_rate": 1.0}, "replay_start_pass_rate must be None or in"),
        ({"question_selection": "greedy"}, "question_selection must be one of"),
        ({"trajectory_selection": "shortest"}, "trajectory_selection must be one of"),
        ({"max_trajectory_candidates": 0}, "max_trajectory_candidates must be None"),
        ({"initial_experience": ""}, "initial_experience must be the path of an `exgrpo export` folder"),
    ],
)
def test_bad_values_name_the_field(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **kwargs)


def test_num_generations_below_two_rejected(tmp_path):
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        ExGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=1, per_device_train_batch_size=8
        )


def test_ablation_values_accepted(tmp_path):
    cfg = make(
        tmp_path,
        policy_shaping_gamma=None,
        replay_importance_correction=False,
        replay_start_pass_rate=None,
        question_selection="uniform",
        trajectory_selection="random",
        replay_ratio=0.0,
    )
    assert cfg.policy_shaping_gamma is None and cfg.replay_start_pass_rate is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"success_reward_threshold": float("nan")},
            "success_reward_threshold must be a finite number (the weighted total reward at which a rollout counts "
            "as solved), got nan.",
        ),
        (
            {"success_reward_threshold": float("inf")},
            "success_reward_threshold must be a finite number (the weighted total reward at which a rollout counts "
            "as solved), got inf.",
        ),
        (
            {"success_reward_threshold": -float("inf")},
            "success_reward_threshold must be a finite number (the weighted total reward at which a rollout counts "
            "as solved), got -inf.",
        ),
        ({"replay_sigma": float("inf")}, "replay_sigma must be finite (in successes), got inf."),
        (
            {"policy_shaping_gamma": float("inf")},
            "policy_shaping_gamma must be > 0 and finite, or None for the plain importance ratio; got inf.",
        ),
        (
            {"max_trajectory_candidates": 2.5},
            "max_trajectory_candidates must be None (every stored trajectory) or an integer >= 1; got 2.5.",
        ),
        (
            {"max_trajectory_candidates": True},
            "max_trajectory_candidates must be None (every stored trajectory) or an integer >= 1; got True.",
        ),
        (
            {"max_trajectory_candidates": 4.0},
            "max_trajectory_candidates must be None (every stored trajectory) or an integer >= 1; got 4.0.",
        ),
    ],
)
def test_non_finite_and_non_integer_values_rejected(tmp_path, kwargs, message):
    """Values that used to be accepted and then trained wrongly without a word."""
    with pytest.raises(ValueError) as info:
        make(tmp_path, **kwargs)
    assert str(info.value) == message


def test_finite_thresholds_and_integer_candidates_accepted(tmp_path):
    cfg = make(tmp_path, success_reward_threshold=0.5, max_trajectory_candidates=2)
    assert (cfg.success_reward_threshold, cfg.max_trajectory_candidates) == (0.5, 2)
    assert make(tmp_path, success_reward_threshold=5, max_trajectory_candidates=None).max_trajectory_candidates is None


def test_derived_switches(tmp_path):
    # replay_ratio 0 replays nothing and skips nothing (GRPOTrainer), unless the diagnostic asks for retirement
    assert (make(tmp_path).replays, make(tmp_path).skips_retired) == (True, True)
    assert (make(tmp_path, replay_ratio=0.0).replays, make(tmp_path, replay_ratio=0.0).skips_retired) == (False, False)
    assert make(tmp_path, replay_ratio=0.0, skip_retired_without_replay=True).skips_retired
    assert not make(tmp_path, skip_retired_questions=False).skips_retired


def test_old_checkpointing_names_are_passed_on():
    """transformers <= 5.17 has gradient_checkpointing(_kwargs) only: the new names set the old ones, unset is TRL's
    default (True), and the two names set to different values are an error (tests/vllm runs it for real on 5.17)."""
    from types import SimpleNamespace

    def passed(**set_fields):
        fields = dict(activation_checkpointing=None, activation_checkpointing_kwargs=None,
                      gradient_checkpointing=None, gradient_checkpointing_kwargs=None)  # fmt: skip
        ns = SimpleNamespace(**{**fields, **set_fields})
        ExGRPOConfig._pass_checkpointing_to_old_names(ns)
        return ns

    default = passed()
    assert (default.gradient_checkpointing, default.activation_checkpointing) == (True, True)
    assert default.gradient_checkpointing_kwargs is None
    assert passed(activation_checkpointing=False).gradient_checkpointing is False
    assert passed(gradient_checkpointing=False).activation_checkpointing is False
    kwargs = {"use_reentrant": False}
    assert passed(activation_checkpointing_kwargs=kwargs).gradient_checkpointing_kwargs == kwargs
    assert passed(activation_checkpointing=True, gradient_checkpointing=True).gradient_checkpointing is True
    with pytest.raises(ValueError, match="activation_checkpointing=False and gradient_checkpointing=True"):
        passed(activation_checkpointing=False, gradient_checkpointing=True)
