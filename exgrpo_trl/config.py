"""`ExGRPOConfig`: TRL's `GRPOConfig` plus the knobs of ExGRPO (arXiv 2510.02245), with the paper's defaults."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from .offline import OFFLINE_GUIDANCE

# transformers renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs) after 5.17; before that
# only the old names exist, and the recipes (which use the new ones) would not parse there without the fields below.
_OLD_CHECKPOINTING_NAMES = "activation_checkpointing" not in {f.name for f in fields(GRPOConfig)}

QUESTION_SELECTIONS = ("gaussian", "uniform")
TRAJECTORY_SELECTIONS = ("lowest_entropy", "random", "highest_entropy")


@dataclass
class ExGRPOConfig(GRPOConfig):
    r"""
    Configuration for [`ExGRPOTrainer`]. Every field of [`~trl.GRPOConfig`] applies unchanged; the fields below add
    ExGRPO's experience management and mixed-policy objective. Defaults follow the paper's Qwen2.5-Math-7B recipe.
    """

    replay_ratio: float = field(
        default=0.5,
        metadata={
            "help": "rho: fraction of the questions of each generation batch drawn from the experience buffer "
            "(n_exp = min(#buffer questions, floor(rho * #questions))). 0 trains exactly like GRPOTrainer. "
            "The paper found 0.5 best (0.25 and 0.75 both did worse)."
        },
    )
    replay_start_pass_rate: float | None = field(
        default=0.35,
        metadata={
            "help": "Delayed start: replay and collection switch on once a purely on-policy batch has Pass@1 strictly "
            "above this value, and stay on. None or 0 replays from the first step (the paper's setting for the "
            "weak Llama-3.1-8B base)."
        },
    )
    replay_mu: float = field(
        default=0.5,
        metadata={
            "help": "Centre of the Gaussian over buckets, as a success rate: buckets are weighted by "
            "N(k; mu * K, sigma) on the success-count scale, favouring medium-difficulty questions."
        },
    )
    replay_sigma: float = field(
        default=1.0,
        metadata={"help": "Width of the Gaussian over buckets, in successes (one success by default)."},
    )
    question_selection: str = field(
        default="gaussian",
        metadata={
            "help": "How replayed questions are drawn: 'gaussian' (bucket weights as above) or 'uniform' over the "
            "buffer (the paper's 'w/o question selection' ablation)."
        },
    )
    replay_cooldown: int = field(
        default=0,
        metadata={
            "help": "Reuse limit: a question replayed in a generation batch is not drawn again for the next N "
            "generation batches (it is replayed at most once every N + 1). When fewer questions are eligible than "
            "the replay count asks for, fewer groups are replayed and the rest are fresh. 0 (default): no limit, "
            "the paper's ExGRPO."
        },
    )
    trajectory_selection: str = field(
        default="lowest_entropy",
        metadata={
            "help": "Which stored trajectory of a replayed question joins its group: 'lowest_entropy' under the "
            "current policy (the paper's choice), 'random', or 'highest_entropy' (ablations)."
        },
    )
    max_trajectory_candidates: int | None = field(
        default=4,
        metadata={
            "help": "M: at most this many stored trajectories of a replayed question are scored for "
            "trajectory_selection: the M with the lowest stored negative log-likelihood (mean -logp under the policy "
            "that sampled them; the highest for 'highest_entropy'), ties to the newest. Scoring costs one no-grad "
            "forward per candidate and a question gains candidates at every visit, so this bounds the cost per "
            "replayed question. None scores every stored trajectory, as in the paper (the paper recipes set it)."
        },
    )
    policy_shaping_gamma: float | None = field(
        default=0.1,
        metadata={
            "help": "gamma of the policy-shaping function f(w) = w / (w + gamma) applied to replayed tokens' "
            "importance weights. None uses the plain ratio w (the 'w/o shaping' ablation)."
        },
    )
    replay_importance_correction: bool = field(
        default=True,
        metadata={
            "help": "Weight replayed tokens by w = exp(logp_theta - logp_behaviour) with the stored behaviour "
            "log-probs. False sets logp_behaviour to the current log-prob, detached (the 'w/o IS' ablation)."
        },
    )
    success_reward_threshold: float = field(
        default=1.0,
        metadata={
            "help": "A rollout whose weighted total reward reaches this value counts as solved (binary verifier "
            "reward: 1.0)."
        },
    )
    skip_retired_questions: bool = field(
        default=True,
        metadata={
            "help": "Skip retired questions (solved K/K) when fresh questions are drawn from the dataset, from the "
            "next epoch on. Applies only while replay_ratio > 0, unless skip_retired_without_replay is set."
        },
    )
    skip_retired_without_replay: bool = field(
        default=False,
        metadata={
            "help": "Also skip retired questions when replay_ratio is 0: GRPO with retired questions skipped, a "
            "diagnostic that isolates retirement from replay. Off by default, so that replay_ratio=0 trains "
            "exactly like GRPOTrainer."
        },
    )
    replay_stored_trajectory: bool = field(
        default=True,
        metadata={
            "help": "Put the selected stored trajectory in its replayed question's group (the paper). False "
            "revisits the questions replay draws with K fresh rollouts and no stored trajectory: a diagnostic that "
            "separates which questions replay brings back from the off-policy row it adds."
        },
    )

    remove_clip_after_replay_start: bool = field(
        default=False,
        metadata={
            "help": "Once replay has started (the delayed start), drop the PPO clip on fresh tokens: their per-token "
            "loss becomes -r * A. The authors' released script does this (loss_remove_clip=True) and the paper "
            "recipes set it; the paper's objective (docs/algorithm.md, section 8) keeps TRL's clipped loss, so it is "
            "off by default. For the PPO-clipped loss types (grpo, bnpo, dr_grpo, dapo, luspo), on batches generated "
            "after the switch. Replayed tokens are never clipped either way."
        },
    )

    offline_solutions_column: str | None = field(
        default=None,
        metadata={
            "help": "Offline guidance (LUFFY's mixed groups, docs/algorithm.md section 11): the train_dataset column "
            "holding one or more reference completions per question (text or an assistant message, as OpenR1-Math's "
            "'target'). A question with one gets it as the first row of its fresh groups, beside K - 1 generated "
            "rollouts, with behaviour probability 1; a solution the reward functions do not score as solved is never "
            "used again. None (default): off, the paper's ExGRPO."
        },
    )
    offline_guidance: str = field(
        default="all_groups",
        metadata={
            "help": "Which fresh groups get an offline solution: 'all_groups' (LUFFY: every group of a question that "
            "has one) or 'unsolved' (only questions the model has not solved itself: no on-policy success stored, "
            "not retired)."
        },
    )

    initial_experience: str | None = field(
        default=None,
        metadata={
            "help": "Seed the experience buffer of a fresh run from a buffer written by `exgrpo export` (its folder, "
            "or its parquet file): each question with its dataset row, its success count k and its trajectories. With "
            "the export's tokenizer the trajectories keep their token ids and behaviour log-probs; with another, "
            "their text is tokenized again and they count as offline (behaviour log-prob 0). Trajectories longer "
            "than max_completion_length are left out; an export of another num_generations is an error. A run "
            "resumed from an ExGRPO checkpoint takes the checkpoint's buffer instead. The seeded questions are "
            "replayed once the delayed start fires (replay_start_pass_rate: 0 replays them from the first batch). "
            "None (default): the buffer starts empty."
        },
    )

    # TRL's default (True) under transformers' deprecated name made every config, and so every `exgrpo train`, warn
    # (FutureWarning: use `activation_checkpointing`) whether or not the option was used. Unset here: __post_init__
    # gives TRL's default to the new name, and transformers warns only when the old name is set.
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated name of activation_checkpointing (transformers 5). Unset: activation_checkpointing "
            "decides, True when that is unset too (TRL's default)."
        },
    )
    if _OLD_CHECKPOINTING_NAMES:  # transformers <= 5.17: the new names, passed on to the old ones in __post_init__
        activation_checkpointing: bool | None = field(
            default=None,
            metadata={
                "help": "Activation (gradient) checkpointing; this transformers calls it gradient_checkpointing. "
                "Unset: True (TRL's default)."
            },
        )
        activation_checkpointing_kwargs: dict | str | None = field(
            default=None,
            metadata={"help": "Keyword arguments of activation checkpointing (gradient_checkpointing_kwargs)."},
        )

    @property
    def replays(self) -> bool:
        """Whether this config replays at all (replay_ratio > 0); False trains exactly like GRPOTrainer."""
        return self.replay_ratio > 0

    @property
    def skips_retired(self) -> bool:
        """Whether retired questions are left out when fresh questions are drawn (from the next epoch on)."""
        return self.skip_retired_questions and (self.replays or self.skip_retired_without_replay)

    @classmethod
    def from_grpo_config(cls, config: GRPOConfig, **exgrpo_fields) -> ExGRPOConfig:
        """An `ExGRPOConfig` that trains like `config` (every GRPOConfig setting, batch sizes included), with
        ExGRPO's own fields from `exgrpo_fields` (the paper's defaults otherwise)::

            args = ExGRPOConfig.from_grpo_config(grpo_args, replay_ratio=0.5)
        """
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"from_grpo_config needs a GRPOConfig, got {type(config).__name__}.")
        own = {f.name for f in fields(cls)} - {f.name for f in fields(GRPOConfig)}
        unknown = sorted(set(exgrpo_fields) - own)
        if unknown:
            raise TypeError(
                f"from_grpo_config takes ExGRPO's own fields only, got {', '.join(unknown)}; set GRPOConfig fields "
                "on the GRPOConfig itself."
            )
        values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
        # GRPOConfig.__post_init__ derives the one of these two that was left unset from the other and rejects both
        # set, so a finished config cannot be passed back as it is. The generation batch alone derives the same
        # steps_per_generation again (same per-device batch and number of processes).
        values["steps_per_generation"] = None
        values.update(exgrpo_fields)
        return cls(**values)

    def __post_init__(self):
        self._validate_exgrpo_fields()
        if _OLD_CHECKPOINTING_NAMES:
            self._pass_checkpointing_to_old_names()
        elif self.gradient_checkpointing is None and self.activation_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default
        super().__post_init__()

    def _pass_checkpointing_to_old_names(self):
        """transformers <= 5.17 reads gradient_checkpointing(_kwargs) only: the new names set them (both set and
        different is an error, as in later transformers), unset means TRL's default, True."""
        for new, old in (("activation_checkpointing", "gradient_checkpointing"),
                         ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")):  # fmt: skip
            a, b = getattr(self, new), getattr(self, old)
            if a is not None and b is not None and a != b:
                raise ValueError(f"{new}={a!r} and {old}={b!r} disagree: set one of them ({old} is the old name).")
            setattr(self, old, a if b is None else b)
        if self.gradient_checkpointing is None:
            self.gradient_checkpointing = True  # TRL's default
        self.activation_checkpointing = self.gradient_checkpointing

    def _validate_exgrpo_fields(self):
        if not 0.0 <= self.replay_ratio <= 1.0:
            raise ValueError(f"replay_ratio must be in [0, 1], got {self.replay_ratio}.")
        if self.replay_start_pass_rate is not None and not 0.0 <= self.replay_start_pass_rate < 1.0:
            raise ValueError(
                f"replay_start_pass_rate must be None or in [0, 1), got {self.replay_start_pass_rate}; "
                "use None or 0 to replay from the first step."
            )
        if not 0.0 <= self.replay_mu <= 1.0:
            raise ValueError(f"replay_mu must be in [0, 1] (a success rate), got {self.replay_mu}.")
        if not self.replay_sigma > 0.0:
            raise ValueError(f"replay_sigma must be > 0 (in successes), got {self.replay_sigma}.")
        if self.question_selection not in QUESTION_SELECTIONS:
            raise ValueError(
                f"question_selection must be one of {QUESTION_SELECTIONS}, got {self.question_selection!r}."
            )
        if self.trajectory_selection not in TRAJECTORY_SELECTIONS:
            raise ValueError(
                f"trajectory_selection must be one of {TRAJECTORY_SELECTIONS}, got {self.trajectory_selection!r}."
            )
        c = self.replay_cooldown
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"replay_cooldown must be an integer >= 0 (generation batches), got {c!r}.")
        m = self.max_trajectory_candidates
        # bool is an int in Python, and a float such as 2.5 would silently shortlist 2 (slicing) or fail later
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(
                f"max_trajectory_candidates must be None (every stored trajectory) or an integer >= 1; got {m!r}."
            )
        if self.policy_shaping_gamma is not None and not 0.0 < self.policy_shaping_gamma < math.inf:
            raise ValueError(
                f"policy_shaping_gamma must be > 0 and finite, or None for the plain importance ratio; "
                f"got {self.policy_shaping_gamma}."
            )
        if not math.isfinite(self.replay_sigma):
            raise ValueError(f"replay_sigma must be finite (in successes), got {self.replay_sigma}.")
        # NaN compares False with everything: no rollout would ever count as solved and the buffer would stay empty
        if not math.isfinite(self.success_reward_threshold):
            raise ValueError(
                f"success_reward_threshold must be a finite number (the weighted total reward at which a rollout "
                f"counts as solved), got {self.success_reward_threshold}."
            )
        if self.offline_guidance not in OFFLINE_GUIDANCE:
            raise ValueError(f"offline_guidance must be one of {OFFLINE_GUIDANCE}, got {self.offline_guidance!r}.")
        if self.offline_solutions_column is not None and not (
            isinstance(self.offline_solutions_column, str) and self.offline_solutions_column
        ):
            raise ValueError(
                f"offline_solutions_column must be a column name or None, got {self.offline_solutions_column!r}."
            )
        if isinstance(self.initial_experience, os.PathLike):  # a pathlib.Path from Python: kept as text (to_dict)
            self.initial_experience = os.fspath(self.initial_experience)
        if self.initial_experience is not None and not (
            isinstance(self.initial_experience, str) and self.initial_experience
        ):
            raise ValueError(
                f"initial_experience must be the path of an `exgrpo export` folder or parquet file, or None; got "
                f"{self.initial_experience!r}."
            )
        if self.num_generations is not None and self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 for ExGRPO (a group needs K-1 fresh rollouts beside a replayed one "
                f"and success buckets 1..K-1); got {self.num_generations}."
            )
