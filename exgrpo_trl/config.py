"""`ExGRPOConfig`: TRL's `GRPOConfig` plus the knobs of ExGRPO (arXiv 2510.02245), with the paper's defaults."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from trl import GRPOConfig

from .settings import ExGRPOSettings, num_generations_problem, settings_fields

# transformers renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs) after 5.17; before that
# only the old names exist, and the recipes (which use the new ones) would not parse there without the fields below.
_OLD_CHECKPOINTING_NAMES = "activation_checkpointing" not in {f.name for f in fields(GRPOConfig)}


@dataclass
class ExGRPOConfig(ExGRPOSettings, GRPOConfig):
    r"""
    Configuration for [`ExGRPOTrainer`]: every field of [`~trl.GRPOConfig`], unchanged, and ExGRPO's own
    ([`~exgrpo_trl.settings.ExGRPOSettings`]: experience management and the mixed-policy objective, defaults from the
    paper's Qwen2.5-Math-7B recipe), after them.
    """

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

    @classmethod
    def from_grpo_config(cls, config: GRPOConfig, **exgrpo_fields) -> ExGRPOConfig:
        """An `ExGRPOConfig` that trains like `config` (every GRPOConfig setting, batch sizes included), with
        ExGRPO's own fields from `exgrpo_fields` (the paper's defaults otherwise)::

            args = ExGRPOConfig.from_grpo_config(grpo_args, replay_ratio=0.5)
        """
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"from_grpo_config needs a GRPOConfig, got {type(config).__name__}.")
        own = {f.name for f in settings_fields()}
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
        ExGRPOSettings.validate(self)
        problem = num_generations_problem(self.num_generations)
        if problem is not None:
            raise ValueError(problem)
        if _OLD_CHECKPOINTING_NAMES:
            self._pass_checkpointing_to_old_names()
        elif self.gradient_checkpointing is None and self.activation_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default
        GRPOConfig.__post_init__(self)

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
