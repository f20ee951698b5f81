"""`ExGRPOSettings`: every knob of ExGRPO (arXiv 2510.02245) in one dataclass, with its help and its check.

The one place a setting is written down. `ExGRPOConfig` extends it with TRL's `GRPOConfig`; the experience buffer, the
run, the offline guide, the model card, the saved state's shape checks and the resume warning all read the fields
from here (`sampling_settings`, `card_rows`), so a new setting is one field here and the code where it acts. No
torch, trl or transformers imports: the command line checks a recipe's values with it before any of them loads.

Each field's "help" is the option's help (`exgrpo train --help`); beside the class, `CARD_LABELS` names the settings
the model card shows and `STATE_KEYS` the buffer's sampling settings with the key the saved state keeps each under
(the same since the first state format, so that older and newer versions read each other's checkpoints). TRL's
argument parser passes a field's metadata to argparse, so nothing but "help" can go there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

QUESTION_SELECTIONS = ("gaussian", "uniform")
REPLAY_PRIORITIES = ("gaussian", "advantage")
TRAJECTORY_SELECTIONS = ("lowest_entropy", "random", "highest_entropy")
OFFLINE_GUIDANCE = ("all_groups", "unsolved")
# TRL's loss types ExGRPO computes its replayed-token term for (loss.aggregate_token_loss), and those whose fresh
# tokens TRL clips PPO-style, clamp(r, 1 - epsilon_low, 1 + epsilon_high): here, free of torch, so that `exgrpo train`
# checks a recipe's loss_type before torch is imported.
SUPPORTED_LOSS_TYPES = ("grpo", "sapo", "bnpo", "dr_grpo", "cispo", "dapo", "vespo", "luspo")
PPO_CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


@dataclass
class ExGRPOSettings:
    """ExGRPO's settings, defaults from the paper's Qwen2.5-Math-7B recipe."""

    replay_ratio: float = field(
        default=0.5,
        metadata={
            "help": "rho: fraction of the questions of each generation batch drawn from the experience buffer "
            "(n_exp = min(#buffer questions, floor(rho * #questions))). 0 trains exactly like GRPOTrainer. "
            "The paper found 0.5 best (0.25 and 0.75 both did worse).",
        },
    )
    replay_start_pass_rate: float | None = field(
        default=0.35,
        metadata={
            "help": "Delayed start: replay and collection switch on once a purely on-policy batch has Pass@1 strictly "
            "above this value, and stay on. None or 0 replays from the first step (the paper's setting for the "
            "weak Llama-3.1-8B base).",
        },
    )
    replay_mu: float = field(
        default=0.5,
        metadata={
            "help": "Centre of the Gaussian over buckets, as a success rate: buckets are weighted by "
            "N(k; mu * K, sigma) on the success-count scale, favouring medium-difficulty questions.",
        },
    )
    replay_sigma: float = field(
        default=1.0,
        metadata={
            "help": "Width of the Gaussian over buckets, in successes (one success by default).",
        },
    )
    question_selection: str = field(
        default="gaussian",
        metadata={
            "help": "How replayed questions are drawn: 'gaussian' (bucket weights as above) or 'uniform' over the "
            "buffer (the paper's 'w/o question selection' ablation).",
        },
    )
    replay_cooldown: int = field(
        default=0,
        metadata={
            "help": "Reuse limit: a question replayed in a generation batch is not drawn again for the next N "
            "generation batches (it is replayed at most once every N + 1). When fewer questions are eligible than "
            "the replay count asks for, fewer groups are replayed and the rest are fresh. 0 (default): no limit, "
            "the paper's ExGRPO.",
        },
    )
    replay_max_age: int | None = field(
        default=None,
        metadata={
            "help": "Age limit: a stored trajectory collected more than N generation batches ago is neither replayed "
            "nor kept (dropped at the next draw; a question left with none leaves the buffer, not retired). The "
            "rollout-level buffer of arXiv 2606.04560 evicts rollouts older than tau_max training steps. None "
            "(default): no limit, the paper's ExGRPO.",
        },
    )
    replay_max_uses: int | None = field(
        default=None,
        metadata={
            "help": "Use cap: a stored trajectory replayed N times leaves the buffer (a question left with none "
            "leaves it too, not retired); Trinity-RFT's use_count_limit, Prompt Replay's max reuse (arXiv "
            "2603.21177). None (default): no cap, the paper's ExGRPO.",
        },
    )
    replay_priority: str = field(
        default="gaussian",
        metadata={
            "help": "How replayed questions are weighted: 'gaussian' (ExGRPO: question_selection's rule) or "
            "'advantage': in proportion to the |advantage| TRL gave the question's latest stored success when it "
            "was collected (arXiv 2606.04560 samples rollouts by |advantage|), without replacement.",
        },
    )
    trajectory_selection: str = field(
        default="lowest_entropy",
        metadata={
            "help": "Which stored trajectory of a replayed question joins its group: 'lowest_entropy' under the "
            "current policy (the paper's choice), 'random', or 'highest_entropy' (ablations).",
        },
    )
    max_trajectory_candidates: int | None = field(
        default=4,
        metadata={
            "help": "M: at most this many stored trajectories of a replayed question are scored for "
            "trajectory_selection: the M with the lowest stored negative log-likelihood (mean -logp under the policy "
            "that sampled them; the highest for 'highest_entropy'), ties to the newest. Scoring costs one no-grad "
            "forward per candidate and a question gains candidates at every visit, so this bounds the cost per "
            "replayed question. None scores every stored trajectory, as in the paper (the paper recipes set it).",
        },
    )
    policy_shaping_gamma: float | None = field(
        default=0.1,
        metadata={
            "help": "gamma of the policy-shaping function f(w) = w / (w + gamma) applied to replayed tokens' "
            "importance weights. None uses the plain ratio w (the 'w/o shaping' ablation).",
        },
    )
    replay_importance_correction: bool = field(
        default=True,
        metadata={
            "help": "Weight replayed tokens by w = exp(logp_theta - logp_behaviour) with the stored behaviour "
            "log-probs. False sets logp_behaviour to the current log-prob, detached (the 'w/o IS' ablation).",
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
            "used again. Any column, 'answer' included; `exgrpo train` keeps it in the data by itself (no "
            "keep_columns entry). None (default): off, the paper's ExGRPO."
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

    vllm_server_request_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Server mode (use_vllm, vllm_mode='server'): the longest, in seconds, any request to the vLLM "
            "server may go unanswered before the run stops with one line naming the server and its address (a "
            "server that stops answering without dying). A killed server is told after TRL's own 5 connection "
            "retries, about a minute. Set it above your longest generation batch: the default is 30 minutes."
        },
    )

    def __post_init__(self):
        self.validate()

    @property
    def replays(self) -> bool:
        """Whether these settings replay at all (replay_ratio > 0); False trains exactly like GRPOTrainer."""
        return self.replay_ratio > 0

    @property
    def skips_retired(self) -> bool:
        """Whether retired questions are left out when fresh questions are drawn (from the next epoch on)."""
        return self.skip_retired_questions and (self.replays or self.skip_retired_without_replay)

    @property
    def replay_starts_at_once(self) -> bool:
        """Whether replay is on from the first batch (no delayed start)."""
        return not self.replay_start_pass_rate

    def validate(self) -> None:
        """ValueError naming the first setting whose value cannot train, and what to do."""
        for f in fields(ExGRPOSettings):
            problem = _CHECKS.get(f.name, lambda v: None)(getattr(self, f.name))
            if problem:
                raise ValueError(f"{f.name} {problem}")
        if self.replay_priority == "advantage" and self.question_selection != "gaussian":
            raise ValueError(
                f"replay_priority 'advantage' replaces question_selection's rule; question_selection "
                f"{self.question_selection!r} asks for another: set one of them"
            )
        if isinstance(self.initial_experience, os.PathLike):  # a pathlib.Path from Python: kept as text (to_dict)
            self.initial_experience = os.fspath(self.initial_experience)


def _one_of(choices):
    return lambda v: None if v in choices else f"must be one of {choices}, got {v!r}."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # bool is an int in Python


def _path_or_none(v) -> str | None:
    if v is None or isinstance(v, os.PathLike) or (isinstance(v, str) and v):
        return None
    return f"must be the path of an `exgrpo export` folder or parquet file, or None; got {v!r}."


# setting -> its check: None when the value can train, else the rest of the sentence after the setting's name
_CHECKS: dict[str, Any] = {
    "replay_ratio": lambda v: None if 0.0 <= v <= 1.0 else f"must be in [0, 1], got {v}.",
    "replay_start_pass_rate": lambda v: (
        None
        if v is None or 0.0 <= v < 1.0
        else f"must be None or in [0, 1), got {v}; use None or 0 to replay from the first step."
    ),
    "replay_mu": lambda v: None if 0.0 <= v <= 1.0 else f"must be in [0, 1] (a success rate), got {v}.",
    "replay_sigma": lambda v: (
        f"must be > 0 (in successes), got {v}."
        if not v > 0.0
        else None
        if math.isfinite(v)
        else f"must be finite (in successes), got {v}."
    ),
    "question_selection": _one_of(QUESTION_SELECTIONS),
    "replay_cooldown": lambda v: (
        None if _is_int(v) and v >= 0 else f"must be an integer >= 0 (generation batches), got {v!r}."
    ),
    "replay_max_age": lambda v: (
        None
        if v is None or (_is_int(v) and v >= 1)
        else f"must be None or an integer >= 1 (generation batches), got {v!r}."
    ),
    "replay_max_uses": lambda v: (
        None if v is None or (_is_int(v) and v >= 1) else f"must be None or an integer >= 1 (replays), got {v!r}."
    ),
    "replay_priority": _one_of(REPLAY_PRIORITIES),
    "trajectory_selection": _one_of(TRAJECTORY_SELECTIONS),
    # a float such as 2.5 would silently shortlist 2 (slicing) or fail later
    "max_trajectory_candidates": lambda v: (
        None
        if v is None or (_is_int(v) and v >= 1)
        else f"must be None (every stored trajectory) or an integer >= 1; got {v!r}."
    ),
    "policy_shaping_gamma": lambda v: (
        None
        if v is None or 0.0 < v < math.inf
        else f"must be > 0 and finite, or None for the plain importance ratio; got {v}."
    ),
    # NaN compares False with everything: no rollout would ever count as solved and the buffer would stay empty
    "success_reward_threshold": lambda v: (
        None
        if math.isfinite(v)
        else f"must be a finite number (the weighted total reward at which a rollout counts as solved), got {v}."
    ),
    "offline_guidance": _one_of(OFFLINE_GUIDANCE),
    "offline_solutions_column": lambda v: (
        None if v is None or (isinstance(v, str) and v) else f"must be a column name or None, got {v!r}."
    ),
    "initial_experience": _path_or_none,
    "vllm_server_request_timeout": lambda v: (
        None if isinstance(v, (int, float)) and 0 < v < math.inf else f"must be a number of seconds > 0, got {v!r}."
    ),
}


def num_generations_problem(num_generations: int | None) -> str | None:
    """Why TRL's `num_generations` (K) cannot train ExGRPO (the whole message), or None."""
    if num_generations is not None and num_generations < 2:
        return (
            f"num_generations must be >= 2 for ExGRPO (a group needs K-1 fresh rollouts beside a replayed one and "
            f"success buckets 1..K-1); got {num_generations}."
        )
    return None


def clip_removal_problem(settings: ExGRPOSettings, loss_type: str) -> str | None:
    """Why `remove_clip_after_replay_start` cannot act with TRL's `loss_type` (the whole message), or None."""
    if settings.remove_clip_after_replay_start and loss_type not in PPO_CLIPPED_LOSS_TYPES:
        return (
            f"remove_clip_after_replay_start removes the PPO clip of loss_type in {PPO_CLIPPED_LOSS_TYPES}; "
            f"loss_type {loss_type!r} has none to remove."
        )
    return None


# The model card's label of each setting it shows (`card_rows`), in field order.
CARD_LABELS = {
    "replay_ratio": "replay ratio (rho)",
    "replay_start_pass_rate": "delayed start (batch Pass@1 >; 0 or None: from the first step)",
    "replay_mu": "bucket Gaussian centre (mu, a success rate)",
    "replay_sigma": "bucket Gaussian width (sigma, successes)",
    "question_selection": "question selection",
    "replay_cooldown": "reuse limit (generation batches a replayed question sits out)",
    "trajectory_selection": "trajectory selection",
    "max_trajectory_candidates": "trajectory candidates scored (None: every stored one)",
    "policy_shaping_gamma": "policy shaping gamma (None: plain importance ratio)",
    "replay_importance_correction": "importance correction",
    "offline_solutions_column": "offline solutions column (None: no offline guidance)",
    "offline_guidance": "offline guidance (which fresh groups get a solution)",
    # shown when set to other than their default (`card_rows`)
    "replay_max_age": "age limit (generation batches a stored trajectory is kept; None: no limit)",
    "replay_max_uses": "use cap (replays of a stored trajectory; None: no cap)",
    "replay_priority": "question priority",
    "success_reward_threshold": "success threshold (weighted total reward >=)",
    "skip_retired_questions": "retired questions skipped when fresh ones are drawn",
    "skip_retired_without_replay": "retired questions skipped at replay ratio 0 too",
    "replay_stored_trajectory": "stored trajectory in a replayed group (False: K fresh rollouts)",
    "remove_clip_after_replay_start": "PPO clip removed on fresh tokens once replay starts",
    "initial_experience": "buffer seeded from (initial_experience)",
    "vllm_server_request_timeout": "longest wait for the vLLM server (seconds)",
}
CARD_ALWAYS = tuple(list(CARD_LABELS)[:12])  # the main settings, shown whatever their value
# The experience buffer's sampling settings (`sampling_settings`) -> the key its saved state keeps each under.
STATE_KEYS = {"replay_mu": "mu", "replay_sigma": "sigma", "question_selection": "question_selection",
              "replay_cooldown": "cooldown", "replay_max_age": "max_age", "replay_max_uses": "max_uses",
              "replay_priority": "priority"}  # fmt: skip


def settings_fields() -> tuple:
    """The fields of `ExGRPOSettings` (those `ExGRPOConfig` adds to GRPOConfig)."""
    return fields(ExGRPOSettings)


def sampling_settings() -> dict[str, tuple[str, Any]]:
    """The experience buffer's sampling settings: field name -> (the key the saved state keeps it under, its
    default: what a state saved before the setting existed had)."""
    defaults = {f.name: f.default for f in fields(ExGRPOSettings)}
    return {name: (key, defaults[name]) for name, key in STATE_KEYS.items()}


def card_rows(settings: ExGRPOSettings) -> list[tuple[str, Any]]:
    """(label, value) of each setting the model card shows: the main ones (`CARD_ALWAYS`), then every other one set
    to other than its default, in `CARD_LABELS` order (every field has a label there)."""
    defaults = {f.name: f.default for f in fields(ExGRPOSettings)}
    return [
        (label, getattr(settings, name))
        for name, label in CARD_LABELS.items()
        if name in CARD_ALWAYS or getattr(settings, name) != defaults[name]
    ]


def settings_of(config: Any) -> ExGRPOSettings:
    """The ExGRPO settings of `config` (an `ExGRPOConfig` is one; any object with the fields is read field by
    field)."""
    if isinstance(config, ExGRPOSettings):
        return config
    return ExGRPOSettings(**{f.name: getattr(config, f.name) for f in fields(ExGRPOSettings)})


# The settings that name a file or folder the run reads, with what to give instead: checked to exist before a run
# (`missing_files`), not when a config is built (a recipe may be written where the file is not).
FILE_SETTINGS = {"initial_experience": "give the folder or parquet file `exgrpo export` wrote"}


def missing_files(values: dict[str, Any]) -> str | None:
    """The first of `FILE_SETTINGS` in `values` (a recipe's and the command line's options) that names a path that
    does not exist, as a one-line message; None when all are there."""
    for name, hint in FILE_SETTINGS.items():
        path = values.get(name)
        if isinstance(path, str) and path and not os.path.exists(os.path.expanduser(path)):
            return f"{name} {path} does not exist: {hint}"
    return None
