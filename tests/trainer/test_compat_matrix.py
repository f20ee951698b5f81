"""Compatibility matrix: ExGRPOTrainer under each configuration a GRPOTrainer user may have, with replay
really firing.

Every case trains the tiny model of `conftest.py` on its synthetic task (an untrained model ends about half of its
completions with EOS, so groups land in every success bucket from the first batch) with replay on from the first
step (`replay_start_pass_rate=0`), 3-4 steps; the multi-turn cases (tools, environment_factory with one environment
or a dict of them, rollout_func) train the calculator task of `tool_tasks.py` instead, whose rollouts call tools.
Every case then checks, from the recorded batches (`RecordingTrainer`) and the reward functions' own record of what
they were given and returned:

- replay fired: each generation batch replayed min(#buffer questions, floor(rho * #groups)) groups, more than 0 in
  all; a replayed group is its question's K rows with the selected stored trajectory in its first row, which is
  what the reward functions scored there; the buffer holds trajectories; the replayed-token loss was logged and
  negative (stored trajectories are successes: A >= 0);
- TRL's advantages, recomputed here from the recorded rewards with the case's reward weights, `scale_rewards` and
  `multi_objective_aggregation` (NaN-aware, as TRL documents them), match the batch's: so the mixed groups were
  scored as GRPO scores any group, and those settings were not ignored;
- the success counts that went into the buffer follow the weighted reward and `success_reward_threshold`, and only
  solved, EOS-terminated, fresh rows of groups with 0 < k < K were stored;
- every logged loss and metric is a finite number, and the parameters moved and stayed finite.

Each case adds what shows its own setting took effect: a loss recomputed in closed form, a paired run without the
setting (same seed: identical until the setting can act, different after), or the metric TRL logs for it.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from exgrpo_trl import ExGRPOConfig
from exgrpo_trl.buffer import question_key
from exgrpo_trl.trainer import BatchKey
from tests.helpers import make_model, make_reward, make_reward_model, make_trainer, synthetic_dataset
from tests.support.recording import RecordingTrainer

K = 8
RUN_TIMES: dict[str, float] = {}


# ------------------------------------------------------------------------------------------------ reward functions
class RewardLog:
    """What each reward function was given (completion ids) and returned, one entry per generation batch."""

    def __init__(self):
        self.names: list[str] = []
        self.calls: dict[str, list[tuple[list[list[int]] | None, list[float]]]] = defaultdict(list)

    def wrap(self, fn: Callable, name: str) -> Callable:
        def reward(completion_ids, **kwargs):
            out = fn(completion_ids=completion_ids, **kwargs)
            self.calls[name].append(
                ([list(ids) for ids in completion_ids], [math.nan if r is None else r for r in out])
            )
            return out

        reward.__name__ = name
        self.names.append(name)
        return reward

    def watch_model(self, model: torch.nn.Module, name: str) -> None:
        def hook(module, args, output):
            self.calls[name].append((None, output.logits[:, 0].float().tolist()))

        model.register_forward_hook(hook)
        self.names.append(name)

    def rewards(self, batch: int) -> torch.Tensor:
        """(N, F) rewards of one generation batch, NaN where a function returned None."""
        return torch.tensor([self.calls[name][batch][1] for name in self.names], dtype=torch.float64).T


def short_answer(tokenizer) -> Callable:
    return make_reward(tokenizer)  # 1.0 when the completion ends with EOS within 6 tokens (or the row is `always`)


def truncated(tokenizer) -> Callable:
    """1.0 for a completion that does not end with EOS: a penalty, given weight -0.5. Success then depends on the
    weights: weighted, a truncated row totals at most 0.5 (never solved); with the weights ignored, 1 or 2 (solved)."""
    eos = tokenizer.eos_token_id

    def truncated(completion_ids, **kwargs):
        return [0.0 if ids and ids[-1] == eos else 1.0 for ids in completion_ids]

    return truncated


UNSCORABLE = ("3=", "7=")  # questions "a+3=", "a+7=": both routed functions return None, every row unscorable


def routed(tokenizer, parity: int) -> Callable:
    """The short-answer reward, only for completions whose length has the given parity (None for the others), and
    for no row of a question whose prompt ends with "3=" or "7=". Two of these cover every other row once."""
    base = short_answer(tokenizer)

    def reward(completion_ids, prompts, always, **kwargs):
        scores = base(completion_ids=completion_ids, always=always)
        return [
            None if (p.endswith(UNSCORABLE) or len(ids) % 2 != parity) else s
            for p, ids, s in zip(prompts, completion_ids, scores)
        ]

    return reward


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% if message['role'] == 'assistant' %}<eos>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


# ------------------------------------------------------------------------------------------------ setups
MULTI_TURN = ("tools", "environment_factory", "environment_factory dict", "rollout_func")


def multi_turn_setup(setup: str, rewards: RewardLog):
    """The calculator task of tests/support/tool_tasks.py in one multi-turn mode: (tokenizer, model, dataset, reward
    functions, GRPOTrainer keywords). The environment-owned reward has its own exact checks in test_multi_turn.py."""
    from datasets import concatenate_datasets

    from tests.support.tool_tasks import (
        add,
        build_tool_tokenizer,
        calculator_dataset,
        calculator_reward,
        calculator_rollout,
        env_classes,
        make_tool_model,
        mul,
        rollout_reward,
    )

    tokenizer = build_tool_tokenizer()
    calculator, _, adder, multiplier = env_classes()
    dataset, reward = calculator_dataset(), calculator_reward
    if setup == "tools":
        extra = {"tools": [add, mul]}
    elif setup == "environment_factory":
        extra = {"environment_factory": calculator}
    elif setup == "environment_factory dict":
        adds = calculator_dataset(16, "+").map(lambda row: {"environment": "adder"})
        muls = calculator_dataset(16, "*", start=16).map(lambda row: {"environment": "multiplier"})
        dataset = concatenate_datasets([adds, muls])
        extra = {"environment_factory": {"adder": adder, "multiplier": multiplier}}
    else:
        reward, extra = rollout_reward, {"rollout_func": calculator_rollout}
    return tokenizer, make_tool_model(tokenizer), dataset, [rewards.wrap(reward, "calculator")], extra


@dataclasses.dataclass
class Run:
    trainer: RecordingTrainer
    rewards: RewardLog
    weights: list[float]
    config: ExGRPOConfig
    tokenizer: Any
    initial: dict[str, torch.Tensor]  # the policy's parameters before training (name as in the trained model)
    ref_initial: dict[str, torch.Tensor] | None = None

    @property
    def history(self) -> list[dict]:
        return [h for h in self.trainer.state.log_history if "loss" in h]

    def series(self, key: str) -> list[float]:
        return [h[key] for h in self.history if key in h]


def build_run(setup: str, config: dict, out_dir, tokenizer, model_dir) -> Run:
    """Train one case. `setup` picks the data, reward functions, model source and adapters."""
    from transformers import PreTrainedModel

    rewards = RewardLog()
    dataset = synthetic_dataset()
    processing_class = tokenizer
    model: PreTrainedModel | str = make_model(tokenizer)
    extra: dict[str, Any] = {}
    config = dict(config)
    if setup in MULTI_TURN:
        processing_class, model, dataset, reward_funcs, extra = multi_turn_setup(setup, rewards)
        config.setdefault("max_completion_length", 32)
        config.setdefault("learning_rate", 1e-3)
    elif setup == "conversational":
        from exgrpo_trl.tasks.toy import build_char_tokenizer

        processing_class = build_char_tokenizer()
        processing_class.chat_template = CHAT_TEMPLATE
        dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"][:-1]}]})
        reward_funcs = [rewards.wrap(short_answer(tokenizer), "short_answer")]
    elif setup == "multi_reward":
        reward_funcs = [
            rewards.wrap(short_answer(tokenizer), "short_answer"),
            rewards.wrap(truncated(tokenizer), "truncated"),
        ]
    elif setup == "reward_model":
        rm = make_reward_model(tokenizer)
        reward_funcs = [rewards.wrap(short_answer(tokenizer), "short_answer"), rm]
        rewards.watch_model(rm, "reward_model")
        extra["reward_processing_classes"] = [None, tokenizer]
    elif setup == "none_rewards":
        reward_funcs = [
            rewards.wrap(routed(tokenizer, 0), "even_length"),
            rewards.wrap(routed(tokenizer, 1), "odd_length"),
        ]
    else:
        reward_funcs = [rewards.wrap(short_answer(tokenizer), "short_answer")]
    peft_config = None
    if config.pop("lora", False):
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )
    if config.get("beta", 0.0) and peft_config is None:
        model = str(model_dir)  # TRL loads the reference model from the policy's path
    trainer = make_trainer(
        out_dir,
        processing_class,
        cls=RecordingTrainer,
        model=model,
        reward_funcs=reward_funcs,
        train_dataset=dataset,
        peft_config=peft_config,
        trainer_kwargs=extra,
        **{"replay_start_pass_rate": 0.0, "max_steps": 3, **config},
    )
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    ref_initial = None
    if trainer.ref_model is not None:
        ref_initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    weights = trainer.reward_weights.tolist()
    return Run(trainer, rewards, weights, trainer.args, processing_class, initial, ref_initial)


# ------------------------------------------------------------------------------------------------ expectations
def expected_advantages(rewards: torch.Tensor, weights, scale: str, aggregation: str) -> np.ndarray:
    """TRL 1.16's advantages as its GRPOConfig documents them, recomputed in numpy from (N, F) rewards."""
    r = rewards.numpy()
    w = np.asarray(weights, dtype=np.float64)
    unscorable = np.isnan(r).all(axis=1)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN groups and single-value stds: NaN, then 0 as TRL
        if aggregation == "sum_then_normalize":
            total = np.where(unscorable, np.nan, np.nansum(r * w, axis=1)).reshape(-1, K)
            centred = total - np.nanmean(total, axis=1, keepdims=True)
            if scale == "group":
                centred = centred / (np.nanstd(total, axis=1, ddof=1, keepdims=True) + 1e-4)
            elif scale == "batch":
                centred = centred / (np.nanstd(total, ddof=1) + 1e-4)
            advantages = centred.reshape(-1)
        else:  # normalize_then_sum (GDPO): each function normalised within its group, weighted sum, batch-normalised
            grouped = r.reshape(-1, K, r.shape[1])
            per_func = (grouped - np.nanmean(grouped, axis=1, keepdims=True)) / (
                np.nanstd(grouped, axis=1, ddof=1, keepdims=True) + 1e-4
            )
            total = np.where(unscorable, np.nan, np.nansum(per_func.reshape(-1, r.shape[1]) * w, axis=1))
            advantages = (total - np.nanmean(total)) / (np.nanstd(total, ddof=1) + 1e-4)
    return np.nan_to_num(advantages, nan=0.0)


def solved_rows(rewards: torch.Tensor, weights, threshold: float) -> torch.Tensor:
    total = (rewards * torch.tensor(weights, dtype=rewards.dtype)).nansum(dim=1)
    return (total >= threshold) & ~torch.isnan(rewards).all(dim=1)


def row_completions(run: Run, b: int) -> list[list[int]]:
    """The completion ids of every row of generation batch b, as TRL handed them to the reward functions."""
    for name in run.rewards.names:
        ids = run.rewards.calls[name][b][0]
        if ids is not None:
            return ids
    raise AssertionError("no reward function recorded completion ids")


def replayed_groups(run: Run) -> int:
    return sum(len(b["plan"].group_indices) for b in run.trainer.batches if b["plan"] is not None)


# ------------------------------------------------------------------------------------------------ common checks
def check_common(run: Run) -> None:
    trainer, cfg = run.trainer, run.config
    eos = run.tokenizer.eos_token_id
    stop_ids = {*trainer.eos_token_ids, run.tokenizer.pad_token_id}
    batches = trainer.batches
    assert batches, "no generation batch"
    for name in run.rewards.names:
        assert len(run.rewards.calls[name]) == len(batches), name  # one scoring per generation batch
    assert len(trainer.rec["flushes"]) == len(batches)

    stored_from_run = set()
    for b, batch in enumerate(batches):
        plan, out, before = batch["plan"], batch["output"], batch["before"]
        n_rows = len(batch["prompts"])
        assert n_rows == cfg.generation_batch_size
        num_groups = n_rows // K
        n_exp = min(before["questions"], math.floor(cfg.replay_ratio * num_groups + 1e-9))
        assert (0 if plan is None else len(plan.group_indices)) == n_exp, b
        completions = row_completions(run, b)
        replay_mask = out.get(BatchKey.REPLAY_MASK, torch.zeros(n_rows, dtype=torch.bool))
        assert int(replay_mask.sum()) == n_exp
        if plan is not None:
            for j, group in enumerate(plan.group_indices):
                rows = range(group * K, (group + 1) * K)
                assert [bool(replay_mask[r]) for r in rows] == [True] + [False] * (K - 1)
                assert {question_key(batch["prompts"][r]) for r in rows} == {plan.keys[j]}
                assert completions[rows[0]] == plan.completion_ids[j]  # the rewards scored the stored trajectory
                assert plan.completion_ids[j] in before["trajectories"][plan.keys[j]]
                assert plan.completion_ids[j][-1] == eos
                assert plan.keys[j] not in before["retired"]

        # TRL's advantages over the mixed groups, recomputed from what the reward functions returned
        rewards = run.rewards.rewards(b)
        assert rewards.shape == (n_rows, len(run.rewards.names))
        expected = expected_advantages(rewards, run.weights, cfg.scale_rewards, cfg.multi_objective_aggregation)
        np.testing.assert_allclose(out["advantages"].double().numpy(), expected, atol=2e-5, rtol=1e-5)

        # success counts and what was stored
        solved = solved_rows(rewards, run.weights, cfg.success_reward_threshold)
        k = solved.view(-1, K).sum(dim=1).tolist()
        flush = trainer.rec["flushes"][b]
        keys = [question_key(p) for p in batch["prompts"]]
        assert sorted((g, key, kk) for g, key, kk in flush["groups"]) == sorted(
            (g, keys[g * K], k[g]) for g in range(num_groups) if k[g] > 0
        )
        for key, ids in flush["trajectories"]:
            matches = [
                r
                for r in range(n_rows)
                if keys[r] == key and completions[r] == ids and not bool(replay_mask[r]) and bool(solved[r])
            ]
            assert matches, (b, key, ids)
            assert ids[-1] in stop_ids and 0 < k[matches[0] // K] < K
            stored_from_run.add((key, tuple(ids)))

    assert replayed_groups(run) > 0
    buffer = trainer.exgrpo_state.buffer
    assert buffer.num_trajectories > 0
    for key, entry in buffer.questions.items():
        for t in entry.trajectories:
            assert (key, tuple(t.completion_ids.tolist())) in stored_from_run
            assert np.isfinite(t.logps.astype(np.float32)).all() and (t.logps <= 0).all()

    # every loss and metric finite; the replayed-token term reached the loss
    for entry in trainer.state.log_history:
        for name, value in entry.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), (name, value, entry.get("step"))
    replay_loss = run.series("exgrpo/replay/loss")
    assert replay_loss and min(replay_loss) < 0, replay_loss
    assert run.series("exgrpo/replay/is_weight_mean")

    # the policy trained and stayed finite
    params = dict(trainer.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    trainable = [n for n, p in params.items() if p.requires_grad]
    assert any(not torch.equal(params[n], run.initial[n]) for n in trainable)


# ------------------------------------------------------------------------------------------------ case checks
def loss_closed_form(run: Run) -> float:
    """Step 1's loss recomputed from its batch: ratio 1, no replay yet, one micro-batch holding the whole batch."""
    out = run.trainer.batches[0]["output"]
    a = out["advantages"].double()
    lengths = out["completion_mask"].double().sum(dim=1)
    nonempty = (lengths > 0).double()
    loss_type = run.config.loss_type
    if loss_type == "grpo":
        return float((-a * nonempty).mean())
    if loss_type == "sapo":
        temperature = torch.where(a > 0, run.config.sapo_temperature_pos, run.config.sapo_temperature_neg)
        return float((-2.0 / temperature * a * nonempty).mean())  # sigmoid(0) * 4 / T
    if loss_type in ("bnpo", "dapo"):
        return float((-a * lengths).sum() / lengths.sum())
    if loss_type == "dr_grpo":
        return float((-a * lengths).sum() / (len(a) * run.config.max_completion_length))
    if loss_type == "luspo":
        return float((-a * lengths).mean())
    raise AssertionError(loss_type)


def check_loss_closed_form(run: Run, base: Run | None) -> None:
    assert run.history[0]["loss"] == pytest.approx(loss_closed_form(run), abs=1e-6)
    ppo_clipped = run.config.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
    assert ("clip_ratio/region_mean" in run.history[0]) == ppo_clipped  # TRL's PPO-clip metrics


def check_cispo_vespo(run: Run, base: Run) -> None:
    # same first batch as the dr_grpo run, a different loss on it; the loss type's own metric
    assert run.trainer.batches[0]["prompts"] == base.trainer.batches[0]["prompts"]
    assert abs(run.history[0]["loss"] - base.history[0]["loss"]) > 1e-3
    if run.config.loss_type == "cispo":
        assert "cispo_clip_ratio" in run.history[0] and "clip_ratio/region_mean" not in run.history[0]
    else:
        assert run.history[0]["vespo/phi_seq_mean"] == pytest.approx(1.0, abs=1e-6)  # phi(1) = 1 on-policy


def check_scale(run: Run, base: Run) -> None:
    # the configured scaling, not "none": the recomputed advantages would not match under "none"
    for b, batch in enumerate(run.trainer.batches):
        unscaled = expected_advantages(run.rewards.rewards(b), run.weights, "none", "sum_then_normalize")
        assert np.abs(batch["output"]["advantages"].numpy() - unscaled).max() > 0.05


def paired_until(first_different_step: int, threshold: float = 1e-4):
    """The run and its paired run without the setting agree (to float noise) on every step's loss before
    `first_different_step` and differ clearly at it: the setting acts, and only where it can."""

    def check(run: Run, base: Run) -> None:
        ours, theirs = run.series("loss"), base.series("loss")
        for step in range(1, first_different_step):
            assert ours[step - 1] == pytest.approx(theirs[step - 1], abs=1e-6), step
        assert abs(ours[first_different_step - 1] - theirs[first_different_step - 1]) > threshold, (ours, theirs)

    return check


def check_same_as_paired(run: Run, base: Run) -> None:
    assert run.series("loss") == pytest.approx(base.series("loss"), abs=1e-6)
    assert replayed_groups(run) == replayed_groups(base)


def check_num_iterations(run: Run, base: Run | None) -> None:
    trainer = run.trainer
    assert len(trainer.batches) == 2 and len(run.history) == 4  # each generation batch trained on twice
    assert all("old_per_token_logps" in b["output"] for b in trainer.batches)
    assert len(run.series("exgrpo/replay/loss")) == 2  # both passes over the replayed batch carry the term
    check_behaviour_is_old_logps(run)
    # the second pass over a batch sees a moved policy: TRL's ratios leave 1 (clipping happens at lr 1e-3)
    assert run.history[1]["clip_ratio/region_mean"] > 0


def check_behaviour_is_old_logps(run: Run) -> None:
    """Stored behaviour log-probs are TRL's old log-probs of the rows they came from (float16 storage)."""
    trainer, checked = run.trainer, 0
    for b, batch in enumerate(trainer.batches):
        out = batch["output"]
        completions = row_completions(run, b)
        keys = [question_key(p) for p in batch["prompts"]]
        for key, ids in trainer.rec["flushes"][b]["trajectories"]:
            row = next(r for r in range(len(keys)) if keys[r] == key and completions[r] == ids)
            entry = trainer.exgrpo_state.buffer.questions.get(key)
            stored = [t for t in (entry.trajectories if entry else []) if t.completion_ids.tolist() == ids]
            if not stored or stored[0].collected_at != b:  # the b-th generation batch's clock
                continue  # retired since, or an identical completion was stored earlier
            old = out["old_per_token_logps"][row, : len(ids)].float()
            torch.testing.assert_close(torch.from_numpy(stored[0].logps.astype(np.float32)), old, atol=2e-3, rtol=1e-3)
            checked += 1
    assert checked > 0


def check_epsilon_high(run: Run, base: Run) -> None:
    paired_until(2)(run, base)
    assert base.history[1]["clip_ratio/high_mean"] > 0  # the paired run clipped some ratios above 1 + epsilon
    assert run.history[1]["clip_ratio/high_mean"] < base.history[1]["clip_ratio/high_mean"]


def check_entropy_coef(run: Run, base: Run) -> None:
    # step 1: loss = TRL's policy loss - coef * mean entropy, the policy loss being the paired run's loss
    first = run.history[0]
    assert first["policy_loss"] == pytest.approx(base.history[0]["loss"], abs=1e-6)
    assert first["loss"] == pytest.approx(base.history[0]["loss"] - 0.01 * first["entropy"], abs=1e-6)
    assert run.series("entropy_coef") == [0.01] * len(run.history)


def check_adaptive_entropy(run: Run, base: Run | None) -> None:
    # entropy (~2.7 nats) is below the target 10: the coefficient rises by entropy_coef_delta every optimizer step
    coefs = run.series("entropy_coef")
    assert coefs == pytest.approx([0.001 + 0.002 * (i + 1) for i in range(len(run.history))])


def check_batching(steps_per_generation: int, micro_batches: int, batches: int):
    def check(run: Run, base: Run | None) -> None:
        trainer = run.trainer
        assert trainer.args.steps_per_generation == steps_per_generation
        assert len(trainer.batches) == batches
        assert len(trainer.rec["steps"]) == micro_batches * len(run.history)  # micro-batches per optimizer step
        if steps_per_generation > trainer.args.gradient_accumulation_steps:
            check_behaviour_is_old_logps(run)  # TRL computed old log-probs: they are what is stored
        else:
            assert all("old_per_token_logps" not in b["output"] for b in trainer.batches)

    return check


def check_kl(run: Run, base: Run) -> None:
    kl = run.series("kl")
    assert len(kl) == len(run.history) and abs(kl[0]) < 1e-6 and kl[-1] > 0  # the reference starts as the policy
    assert all("ref_per_token_logps" in b["output"] for b in run.trainer.batches)
    paired_until(2, threshold=1e-7)(run, base)


def check_sync_ref(run: Run, base: Run) -> None:
    ref = dict(run.trainer.ref_model.named_parameters())
    policy = dict(run.trainer.model.named_parameters())
    moved = [n for n, p in ref.items() if not torch.equal(p, run.ref_initial[n])]
    assert moved and all(not torch.equal(ref[n], policy[n]) for n in moved)  # mixed towards the policy
    assert base.trainer.ref_model is not None
    assert all(torch.equal(p, base.ref_initial[n]) for n, p in base.trainer.ref_model.named_parameters())
    assert run.series("kl")[-1] != pytest.approx(base.series("kl")[-1], abs=1e-9)


def check_lora(run: Run, base: Run | None) -> None:
    from peft import PeftModel

    model = run.trainer.model
    assert isinstance(model, PeftModel)
    params = dict(model.named_parameters())
    lora = [n for n in params if "lora_" in n]
    assert lora and all(params[n].requires_grad for n in lora)
    assert any(not torch.equal(params[n], run.initial[n]) for n in lora if "lora_B" in n)
    assert all(torch.equal(p, run.initial[n]) for n, p in params.items() if "lora_" not in n)  # base frozen
    if run.config.beta:
        kl = run.series("kl")
        assert abs(kl[0]) < 1e-6 and kl[-1] > 0  # the reference is the base model (adapter disabled)


def check_conversational(run: Run, base: Run | None) -> None:
    tok = run.tokenizer
    for batch in run.trainer.batches:
        out = batch["output"]
        for r, prompt in enumerate(batch["prompts"]):
            assert isinstance(prompt, list) and prompt[0]["role"] == "user"
            ids = out["prompt_ids"][r][out["prompt_mask"][r].bool()].tolist()
            assert tok.decode(ids) == prompt[0]["content"] + "="  # the chat template's generation prompt
    for entry in run.trainer.exgrpo_state.buffer.questions.values():
        assert isinstance(entry.row["prompt"], list)  # stored as the conversation it was asked as


def check_multi_reward(run: Run, base: Run | None) -> None:
    assert run.weights == pytest.approx([1.0, -0.5])
    for b, batch in enumerate(run.trainer.batches):
        unweighted = expected_advantages(
            run.rewards.rewards(b), [1.0, 1.0], run.config.scale_rewards, "sum_then_normalize"
        )
        assert np.abs(batch["output"]["advantages"].numpy() - unweighted).max() > 0.01  # the weights acted
    assert {"rewards/short_answer/mean", "rewards/truncated/mean"} <= set(run.history[0])


def check_gdpo(run: Run, base: Run | None) -> None:
    check_multi_reward(run, base)
    for b, batch in enumerate(run.trainer.batches):
        summed = expected_advantages(run.rewards.rewards(b), run.weights, "group", "sum_then_normalize")
        assert np.abs(batch["output"]["advantages"].numpy() - summed).max() > 0.01


def check_reward_model(run: Run, base: Run | None) -> None:
    rm_name = run.trainer.reward_func_names[1]
    assert f"rewards/{rm_name}/mean" in run.history[0]
    for b, batch in enumerate(run.trainer.batches):
        rewards = run.rewards.rewards(b)
        assert rewards[:, 1].std() > 0.05  # the reward model scores rows differently
        without = expected_advantages(rewards[:, :1], run.weights[:1], run.config.scale_rewards, "sum_then_normalize")
        assert np.abs(batch["output"]["advantages"].numpy() - without).max() > 0.01


def check_none_rewards(run: Run, base: Run | None) -> None:
    unscorable_keys, partial = set(), 0
    for b, batch in enumerate(run.trainer.batches):
        rewards = run.rewards.rewards(b)
        nan = torch.isnan(rewards)
        partial += int((nan.any(dim=1) & ~nan.all(dim=1)).sum())
        for r in nan.all(dim=1).nonzero().flatten().tolist():
            assert batch["output"]["advantages"][r] == 0  # an unscorable row carries no signal
            unscorable_keys.add(question_key(batch["prompts"][r]))
    assert partial > 0 and unscorable_keys  # both kinds of None occurred
    buffer = run.trainer.exgrpo_state.buffer
    assert not unscorable_keys & (set(buffer.questions) | buffer.retired)  # never solved, never stored


def check_mask_truncated(run: Run, base: Run) -> None:
    stop_ids, masked = {run.tokenizer.eos_token_id, run.tokenizer.pad_token_id}, 0
    for b, batch in enumerate(run.trainer.batches):
        mask = batch["output"]["completion_mask"]
        for r, ids in enumerate(row_completions(run, b)):
            truncated = not ids or ids[-1] not in stop_ids  # TRL's rule: ends with neither EOS nor pad
            assert bool(mask[r].sum() == 0) == truncated
            masked += truncated
        replayed = batch["output"].get(BatchKey.REPLAY_MASK, torch.zeros(len(mask), dtype=torch.bool))
        assert not (mask.sum(dim=1) == 0)[replayed].any()  # a stored trajectory ends with EOS: never masked
    assert masked > 0
    paired_until(1)(run, base)


def check_metric(key: str, value=None):
    def check(run: Run, base: Run | None) -> None:
        assert key in run.history[0]
        if value is not None:
            assert run.history[0][key] == value

    return check


def check_padding(run: Run, base: Run | None) -> None:
    for batch in run.trainer.batches:
        assert batch["output"]["completion_ids"].shape[1] % 8 == 0 and batch["output"]["prompt_ids"].shape[1] % 8 == 0


def check_temperature(run: Run, base: Run) -> None:
    # TRL divides the logits by the temperature for its log-probs and entropies, and so does entropy scoring
    assert run.history[0]["entropy"] < base.history[0]["entropy"] - 0.03


def check_log_completions(run: Run, base: Run | None) -> None:
    logs = run.trainer._logs
    assert len(logs["extra"]["exgrpo_replayed"]) == len(logs["prompt"]) == run.config.generation_batch_size
    assert any(logs["extra"]["exgrpo_replayed"])


def check_multi_turn(run: Run, base: Run | None) -> None:
    """Stored trajectories keep the tool's answer, masked out; a replayed row trains with its stored mask."""
    trainer = run.trainer
    assert any(t.mask is not None for t in trainer.exgrpo_state.buffer.iter_trajectories())
    for batch in trainer.batches:
        plan, out = batch["plan"], batch["output"]
        assert "tool_mask" in out
        for j, group in enumerate(plan.group_indices if plan is not None else []):
            ids = plan.completion_ids[j]
            assert out["tool_mask"][group * K, : len(ids)].tolist() == plan.mask(j)
    if trainer.rollout_func is None:
        assert "tools/call_frequency" in run.history[0]  # TRL's tool loop ran


def check_no_shuffle(run: Run, base: Run | None) -> None:
    first = run.trainer.batches[0]["prompts"]
    assert first == [p for p in synthetic_dataset()["prompt"][:4] for _ in range(K)]  # dataset order


# ------------------------------------------------------------------------------------------------ the matrix
@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    config: dict = dataclasses.field(default_factory=dict)
    setup: str = "plain"
    check: Callable | None = None
    paired: str | None = None  # the id of the case this one is compared with


ITER2 = {"num_iterations": 2, "max_steps": 4, "learning_rate": 1e-3}

CASES = [
    # loss types (the base case is dr_grpo with scale_rewards none, conftest's settings)
    Case("dr_grpo", {}, check=check_loss_closed_form),
    Case("grpo", {"loss_type": "grpo"}, check=check_loss_closed_form),
    Case("bnpo", {"loss_type": "bnpo"}, check=check_loss_closed_form),
    Case("dapo", {"loss_type": "dapo"}, check=check_loss_closed_form),
    Case("cispo", {"loss_type": "cispo", "epsilon_high": 5.0}, check=check_cispo_vespo, paired="dr_grpo"),
    Case("sapo", {"loss_type": "sapo"}, check=check_loss_closed_form),
    Case(
        "vespo",
        {"loss_type": "vespo", "importance_sampling_level": "token"},
        check=check_cispo_vespo,
        paired="dr_grpo",
    ),
    Case("luspo", {"loss_type": "luspo", "importance_sampling_level": "sequence"}, check=check_loss_closed_form),
    # reward scaling
    Case("scale_rewards=group", {"scale_rewards": "group"}, check=check_scale, paired="dr_grpo"),
    Case("scale_rewards=batch", {"scale_rewards": "batch"}, check=check_scale, paired="dr_grpo"),
    # the policy loss's own settings: a second pass over each batch (num_iterations 2, lr 1e-3) moves the ratios
    Case("num_iterations=2", ITER2, check=check_num_iterations),
    Case(
        "importance_sampling_level=sequence",
        {**ITER2, "importance_sampling_level": "sequence"},
        check=paired_until(2),
        paired="num_iterations=2",
    ),
    Case(
        "delta (two-sided clip)",
        {**ITER2, "epsilon": 0.05, "delta": 1.06},
        check=paired_until(2),
        paired="num_iterations=2 epsilon=0.05",
    ),
    Case("num_iterations=2 epsilon=0.05", {**ITER2, "epsilon": 0.05}),
    Case("epsilon_high", {**ITER2, "epsilon_high": 0.28}, check=check_epsilon_high, paired="num_iterations=2"),
    Case(
        "off_policy_mask_threshold",
        {**ITER2, "off_policy_mask_threshold": 1e-3},
        check=paired_until(2),
        paired="num_iterations=2",
    ),
    Case("top_entropy_quantile=0.2", {"top_entropy_quantile": 0.2}, check=paired_until(1), paired="dr_grpo"),
    Case("entropy_coef=0.01", {"entropy_coef": 0.01}, check=check_entropy_coef, paired="dr_grpo"),
    Case(
        "use_adaptive_entropy",
        {"use_adaptive_entropy": True, "entropy_coef": 0.001, "entropy_coef_delta": 0.002, "entropy_target": 10.0},
        check=check_adaptive_entropy,
    ),
    # batch layout
    Case(
        "steps_per_generation=2 ga=2",
        {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2},
        check=check_batching(2, 2, 3),
    ),
    Case(
        "steps_per_generation=4 ga=2",
        {
            "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 2,
            "steps_per_generation": 4,
            "max_steps": 4,
        },
        check=check_batching(4, 2, 2),
    ),
    Case("generation_batch_size=64", {"generation_batch_size": 64, "max_steps": 4}, check=check_batching(2, 1, 2)),
    # reference model, adapters
    Case("beta=0.04", {"beta": 0.04}, check=check_kl, paired="dr_grpo"),
    Case(
        "sync_ref_model",
        {"beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5},
        check=check_sync_ref,
        paired="beta=0.04",
    ),
    Case("lora", {"lora": True, "learning_rate": 1e-3}, check=check_lora),
    Case("lora beta=0.04", {"lora": True, "learning_rate": 1e-3, "beta": 0.04}, check=check_lora),
    # data and rewards
    Case("conversational", {}, setup="conversational", check=check_conversational),
    Case("reward_weights", {"reward_weights": [1.0, -0.5]}, setup="multi_reward", check=check_multi_reward),
    Case(
        "multi_objective_aggregation=normalize_then_sum",
        {"reward_weights": [1.0, -0.5], "multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "group"},
        setup="multi_reward",
        check=check_gdpo,
    ),
    Case(
        "reward model",
        {"reward_weights": [1.0, 0.1], "success_reward_threshold": 0.8},
        setup="reward_model",
        check=check_reward_model,
    ),
    Case("reward None for some rows", {}, setup="none_rewards", check=check_none_rewards),
    Case(
        "mask_truncated_completions",
        {"mask_truncated_completions": True},
        check=check_mask_truncated,
        paired="dr_grpo",
    ),
    # generation and logging
    Case("gradient_checkpointing", {"gradient_checkpointing": True}, check=check_same_as_paired, paired="dr_grpo"),
    Case("pad_to_multiple_of=8", {"pad_to_multiple_of": 8}, check=check_padding),
    Case("temperature=0.7", {"temperature": 0.7}, check=check_temperature, paired="dr_grpo"),
    Case("log_completions", {"log_completions": True}, check=check_log_completions),
    Case("shuffle_dataset=False", {"shuffle_dataset": False}, check=check_no_shuffle),
    # multi-turn rollouts: tools run by TRL's loop, environments reset from the dataset rows, a rollout
    # function with its own tool loop and env_mask
    *[Case(setup, {}, setup=setup, check=check_multi_turn) for setup in MULTI_TURN],
]
BY_ID = {case.id: case for case in CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer):
    # One thread: these runs are tiny, and on the shared 2-core machine two threads made each run 5-25x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model_dir = tmp_path_factory.mktemp("policy")
    make_model(tokenizer).save_pretrained(model_dir)
    cache: dict[str, Run] = {}

    def get(case_id: str) -> Run:
        if case_id not in cache:
            case = BY_ID[case_id]
            start = time.perf_counter()
            cache[case_id] = build_run(case.setup, case.config, tmp_path_factory.mktemp("run"), tokenizer, model_dir)
            RUN_TIMES[case_id] = time.perf_counter() - start
        return cache[case_id]

    yield get
    torch.set_num_threads(threads)
    print("\ncompatibility matrix: case | replayed groups | buffer questions / trajectories | seconds")
    for case_id, run in cache.items():
        buffer = run.trainer.exgrpo_state.buffer
        print(
            f"  {case_id} | {replayed_groups(run)} | {buffer.num_questions} / {buffer.num_trajectories} | "
            f"{RUN_TIMES[case_id]:.1f}"
        )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_replay_fires_under_grpo_configuration(runs, case):
    run = runs(case.id)
    check_common(run)
    if case.check is not None:
        case.check(run, runs(case.paired) if case.paired else None)


# ------------------------------------------------------------------------------------------------ too small to replay
NEVER_FIRES = (
    "ExGRPO: replay_ratio=0.5 will never replay anything: a generation batch of 8 rows holds 1 question(s) of "
    "num_generations=8 rollouts, and floor(0.5 x 1) = 0 of them come from the buffer. Give a generation batch at "
    "least 2 questions (generation_batch_size >= 16, or more steps_per_generation, gradient_accumulation_steps or "
    "per_device_train_batch_size), or raise replay_ratio; replay_ratio=0 trains GRPO."
)


@pytest.mark.parametrize(
    "overrides, warned, fires",
    [
        ({}, True, False),  # TRL's default shape: 8 rows, K = 8
        ({"replay_ratio": 1.0}, False, True),  # the one question of each batch comes from the buffer
        ({"gradient_accumulation_steps": 2}, False, True),  # two questions per generation batch
        ({"replay_ratio": 0.0}, False, False),  # GRPO: nothing to warn about
    ],
    ids=["rho=0.5", "rho=1", "ga=2", "rho=0"],
)
def test_one_question_per_generation_batch_warns_that_replay_never_fires(
    tmp_path, tokenizer, caplog, overrides, warned, fires
):
    """floor(rho x 1) = 0: with one question per generation batch replay_ratio 0.5 never replays, which TRL's default
    batch shape (per_device_train_batch_size 8, num_generations 8) gives. Said at init, and true of the run."""
    import logging

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with caplog.at_level(logging.WARNING):
            trainer = make_trainer(
                tmp_path,
                tokenizer,
                cls=RecordingTrainer,
                max_steps=4,
                per_device_train_batch_size=8,
                replay_start_pass_rate=0.0,
                **overrides,
            )
        messages = [r.getMessage() for r in caplog.records if "will never replay" in r.getMessage()]
        assert messages == ([NEVER_FIRES] if warned else [])
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    replayed = sum(len(b["plan"].group_indices) for b in trainer.batches if b["plan"] is not None)
    assert (replayed > 0) == fires
    if overrides.get("replay_ratio", 0.5) > 0:
        assert trainer.exgrpo_state.buffer.num_trajectories > 0  # collected all along: only the replay never came
