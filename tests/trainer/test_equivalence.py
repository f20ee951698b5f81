"""replay_ratio=0 reproduces TRL's GRPOTrainer exactly, and the replayed-token term uses TRL's normaliser."""

import pytest
import torch
from trl import GRPOTrainer

from exgrpo_trl import ExGRPOTrainer
from exgrpo_trl.trainer import BatchKey
from tests.helpers import make_model, make_trainer


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_type": "dr_grpo", "scale_rewards": "none"},
        # two micro-batches per generation batch and two per optimizer step: exercises TRL's split/shuffle and
        # the deferred capture of behaviour log-probs across micro-batches
        {"loss_type": "dapo", "per_device_train_batch_size": 16, "gradient_accumulation_steps": 2, "beta": 0.04},
    ],
    ids=["dr_grpo", "dapo-ga2-kl"],
)
def test_replay_ratio_zero_is_grpo_bitwise(tmp_path, tokenizer, overrides):
    model_dir = str(tmp_path / "model")  # loaded by path, so that beta > 0 can load the same reference model
    make_model(tokenizer).save_pretrained(model_dir)

    grpo = make_trainer(tmp_path, tokenizer, cls=GRPOTrainer, model=model_dir, max_steps=3, **overrides)
    grpo.train()
    ex = make_trainer(
        tmp_path, tokenizer, model=model_dir, replay_ratio=0.0, replay_start_pass_rate=0.0, max_steps=3, **overrides
    )
    ex.train()

    # The bookkeeping really ran (the buffer collected), and it did not perturb training.
    assert ex.exgrpo_state.buffer.num_trajectories > 0
    for (name, p_grpo), (_, p_ex) in zip(grpo.model.named_parameters(), ex.model.named_parameters()):
        assert torch.equal(p_grpo, p_ex), name
    reference = make_model(tokenizer)
    assert any(not torch.equal(p, q) for p, q in zip(reference.parameters(), ex.model.parameters()))  # it trained
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(grpo) == losses(ex)


def _batch(trainer, tokenizer, rows=4, length=5):
    """A hand-made training micro-batch: 4 rows, the last one's completion shorter (masked tail)."""
    gen = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(3, len(tokenizer), (rows, length), generator=gen)
    completion_mask = torch.ones(rows, length, dtype=torch.long)
    completion_mask[-1, 3:] = 0
    prompt_ids = torch.randint(3, len(tokenizer), (rows, 3), generator=gen)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([0.5, -1.0, 1.5, -0.25]),
        "num_items_in_batch": completion_mask.sum(),
    }


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "bnpo", "dr_grpo", "cispo", "dapo", "vespo", "luspo"])
def test_replayed_rows_share_trls_normaliser(tmp_path, tokenizer, loss_type):
    """A replayed row with shaping and IS correction off (w = 1, f(w) = w) is on-policy REINFORCE, which is exactly
    what TRL's loss is for a fresh on-policy row (ratio 1, inside the clip range). So ExGRPO's loss on a batch whose
    rows 1 and 3 are 'replayed' must have the same gradient as GRPOTrainer's loss on the same batch, for every loss
    type: that holds only if the replayed term is aggregated with TRL's own normaliser."""
    kwargs = dict(
        loss_type=loss_type,
        per_device_train_batch_size=4,
        num_generations=2,
        gradient_accumulation_steps=2,
        max_completion_length=5,
    )
    if loss_type == "cispo":  # CISPO's clip bound on the ratio (the MiniMax-M1 paper uses ~5; TRL's default 0.2 < 1)
        kwargs["epsilon_high"] = 5.0
    grpo = make_trainer(tmp_path, tokenizer, cls=GRPOTrainer, **kwargs)
    ex = make_trainer(tmp_path, tokenizer, policy_shaping_gamma=None, replay_importance_correction=False, **kwargs)
    batch = _batch(grpo, tokenizer)
    replay = {
        **batch,
        BatchKey.REPLAY_MASK: torch.tensor([False, True, False, True]),
        BatchKey.BEHAVIOUR_LOGPS: torch.full((4, 5), -7.0),
    }  # ignored without IS correction

    for trainer in (grpo, ex):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2  # set by the training loop otherwise
    loss_grpo = grpo._compute_loss(grpo.model, batch)
    loss_ex = ex._compute_loss(ex.model, replay)
    loss_grpo.backward()
    loss_ex.backward()
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):  # per-token loss -ratio * A: equal values too
        assert loss_ex.item() == pytest.approx(loss_grpo.item(), abs=1e-6)
    for (name, p), (_, q) in zip(grpo.model.named_parameters(), ex.model.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5), name
    assert any(p.grad.abs().sum() > 0 for p in ex.model.parameters())


def _multi_turn_setup(mode: str):
    """The task, reward and GRPOTrainer keyword of one multi-turn rollout mode (tests/support/tool_tasks.py)."""
    from tests.support.tool_tasks import add, calculator_reward, calculator_rollout, env_classes, mul, rollout_reward

    calculator, scored, adder, multiplier = env_classes()
    return {
        "tools": (calculator_reward, {"tools": [add, mul]}),
        "environment_factory": (calculator_reward, {"environment_factory": calculator}),
        "environment_factory dict": (
            calculator_reward,
            {"environment_factory": {"adder": adder, "multiplier": multiplier}},
        ),
        "environment-owned reward": ([], {"environment_factory": scored}),
        "rollout_func": (rollout_reward, {"rollout_func": calculator_rollout}),
    }[mode]


@pytest.mark.parametrize(
    "mode", ["tools", "environment_factory", "environment_factory dict", "environment-owned reward", "rollout_func"]
)
def test_replay_ratio_zero_is_grpo_bitwise_multi_turn(tmp_path, monkeypatch, mode):
    """The same with multi-turn rollouts: tools run by TRL's tool loop, environments reset from the dataset rows (one
    environment, a dict of them, one that owns its reward), a rollout function with its own tool loop (`env_mask`).
    Three steps, learning rate 1e-3 so that the policy (and with it which rollouts call which tool) moves between
    steps."""
    from datasets import concatenate_datasets

    from tests.support.tool_tasks import build_tool_tokenizer, calculator_dataset, make_tool_model, one_thread

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = build_tool_tokenizer()
    kwargs = dict(max_steps=3, max_completion_length=32, learning_rate=1e-3)
    dataset = calculator_dataset()
    if mode == "environment_factory dict":  # each row routed to its environment by its `environment` column
        adds = calculator_dataset(16, "+").map(lambda row: {"environment": "adder"})
        muls = calculator_dataset(16, "*", start=16).map(lambda row: {"environment": "multiplier"})
        dataset = concatenate_datasets([adds, muls])
    runs = []
    for trainer_cls, config in (
        (GRPOTrainer, kwargs),
        (ExGRPOTrainer, dict(replay_ratio=0.0, replay_start_pass_rate=0.0, **kwargs)),
    ):
        reward, extra = _multi_turn_setup(mode)  # fresh environment classes for each trainer
        trainer = make_trainer(
            tmp_path,
            tokenizer,
            cls=trainer_cls,
            model=make_tool_model(tokenizer),
            reward_funcs=reward,
            train_dataset=dataset,
            trainer_kwargs=extra,
            **config,
        )
        with one_thread():
            trainer.train()
        runs.append(trainer)
    grpo, ex = runs

    # The bookkeeping ran on multi-turn trajectories (stored with their tool tokens masked out) ...
    stored = list(ex.exgrpo_state.buffer.iter_trajectories())
    assert stored and any(t.mask is not None and not t.mask.all() for t in stored)
    # ... and did not perturb training.
    for (name, p_grpo), (_, p_ex) in zip(grpo.model.named_parameters(), ex.model.named_parameters()):
        assert torch.equal(p_grpo, p_ex), name
    initial = make_tool_model(tokenizer)
    assert any(not torch.equal(p, q) for p, q in zip(initial.parameters(), ex.model.parameters()))  # it trained
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(grpo) == losses(ex)
