"""ExGRPO on multi-turn rollouts: tools, `environment_factory` (one environment, several, one that owns its reward),
malformed and failing tool calls, and `rollout_func` -- the cases of TRL's own GRPOTrainer tests for them, run
against ExGRPOTrainer with replay firing -- plus the calculator task trained a few dozen steps and resumed, and the
replayed-token loss and entropy score of a row with tool tokens derived by hand.

Every run uses the stand-ins of tests/support/tool_tasks.py: a tiny model sampling under a grammar, so its rollouts
call tools through TRL's real tool loop and end with EOS, and about a quarter of them solve their question: successful
multi-turn trajectories are stored from the first batch and replayed (2 of 4 groups) from the second.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer
from exgrpo_trl.buffer import question_key
from exgrpo_trl.checks import ENVIRONMENT_OWNED_DATA, IMAGE_MULTI_TURN
from exgrpo_trl.trainer import BatchKey
from tests.helpers import config_kwargs, make_trainer
from tests.support.recording import RecordingTrainer
from tests.support.tool_tasks import (
    ASYNC_ADD_OR_MUL,
    GOOD_FAILING_OR_MALFORMED,
    TOOL_CALLS,
    add,
    async_add,
    build_tool_tokenizer,
    calculator_dataset,
    calculator_reward,
    calculator_rollout,
    env_classes,
    make_tool_model,
    mul,
    one_thread,
    rollout_reward,
)

K = 8
REPLAYED_GROUPS: dict[str, int] = {}  # test -> replayed groups it observed (printed at the end of the module)


@pytest.fixture(autouse=True)
def _silence_trl_experimental(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print("\nmulti-turn runs: replayed groups", REPLAYED_GROUPS)


class MultiTurnRecorder(RecordingTrainer):
    """Also records what the reward functions were given and what they returned, per generation batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scored: list[dict] = []
        self.count_calls = lambda: len(TOOL_CALLS)  # tool calls run so far

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.model.training:
            self.scored.append(
                {
                    "inputs": copy.deepcopy(inputs),
                    "completions": copy.deepcopy(completions),
                    "completion_ids": [list(ids) for ids in completion_ids_list],
                    "rewards": rewards.clone(),
                    "environments": list(self.environments or []),
                    "tool_calls": self.count_calls(),
                }
            )
        return rewards


def train(tmp_path, *, reward_funcs=calculator_reward, dataset=None, branches=None, max_steps=4, calls=None, **extra):
    """Train a `MultiTurnRecorder` on the calculator task; `calls()` counts the tool calls run so far (default: the
    standalone tools')."""
    tokenizer = build_tool_tokenizer()
    config = dict(max_steps=max_steps, max_completion_length=32, learning_rate=1e-3, replay_start_pass_rate=0.0)
    config.update(extra.pop("config", {}))
    model = make_tool_model(tokenizer) if branches is None else make_tool_model(tokenizer, branches=branches)
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        cls=MultiTurnRecorder,
        model=model,
        reward_funcs=reward_funcs,
        train_dataset=calculator_dataset() if dataset is None else dataset,
        trainer_kwargs=extra,
        **config,
    )
    TOOL_CALLS.clear()
    if calls is not None:
        trainer.count_calls = calls
    trainer.initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with one_thread():
        trainer.train()
    return trainer


def replayed(trainer):
    """(batch index, plan index j, local row of the stored trajectory) of every replayed group."""
    return [
        (b, j, g * K)
        for b, batch in enumerate(trainer.batches)
        if batch["plan"] is not None
        for j, g in enumerate(batch["plan"].group_indices)
    ]


def tool_messages(completion) -> int:
    return sum(1 for message in completion if message["role"] == "tool") if isinstance(completion, list) else 0


def check_replay(trainer, name: str) -> None:
    """What every multi-turn mode must show: replay fired; the replayed row is the stored trajectory, whole (ids, its
    model mask as TRL's tool_mask, the message list the reward functions saw when it was stored); stored trajectories
    are successful, end with the model's EOS and mask out exactly the tool's answer; the policy trained."""
    tokenizer = trainer.processing_class
    groups = replayed(trainer)
    REPLAYED_GROUPS[name] = len(groups)
    assert len(groups) >= 4, groups
    for b, j, row in groups:
        plan, out, scored = trainer.batches[b]["plan"], trainer.batches[b]["output"], trainer.scored[b]
        ids = plan.completion_ids[j]
        assert scored["completion_ids"][row] == ids  # the reward functions scored the stored trajectory ...
        assert out["completion_ids"][row, : len(ids)].tolist() == ids  # ... and it is what trains
        assert out["tool_mask"][row, : len(ids)].tolist() == plan.mask(j)  # tool tokens masked as when stored
        if "completion" in plan.record(j):
            assert scored["completions"][row] == plan.record(j)["completion"]  # with its tool calls and answers
        assert all(scored["inputs"][r]["prompt"] == plan.rows[j]["prompt"] for r in range(row, row + K))
    for entry in trainer.exgrpo_state.buffer.questions.values():
        for t in entry.trajectories:
            ids, mask = t.completion_ids.tolist(), t.model_mask()
            assert ids[-1] == tokenizer.eos_token_id and mask[-1] == 1  # the model ended it
            external = tokenizer.decode([i for i, m in zip(ids, mask) if m == 0])
            assert external == "".join(f"<tool>{r}<bot>" for r in _tool_answers(tokenizer.decode(ids)))
    assert any(t.mask is not None for t in trainer.exgrpo_state.buffer.iter_trajectories())  # with tool tokens
    assert any(not torch.equal(p, trainer.initial[n]) for n, p in trainer.model.named_parameters())
    replay_loss = [h["exgrpo/replay/loss"] for h in trainer.state.log_history if "exgrpo/replay/loss" in h]
    assert replay_loss and all(math.isfinite(x) for x in replay_loss)


def _tool_answers(text: str) -> list[str]:
    """The tool answers inside a decoded multi-turn completion, in order."""
    return [part.split("<bot>")[0] for part in text.split("<tool>")[1:]]


def check_tools_not_rerun(trainer) -> list[int]:
    """Every batch ran exactly the tool calls of its fresh rows: none for the replayed rows, whose stored messages
    do hold calls (so a re-run would have been counted). Returns the calls run per batch."""
    counts = [s["tool_calls"] for s in trainer.scored]
    calls_per_batch = [b - a for a, b in zip([0, *counts], counts)]
    replayed_rows = {(b, row) for b, _, row in replayed(trainer)}
    replayed_calls = 0
    for b, scored in enumerate(trainer.scored):
        fresh = sum(tool_messages(c) for r, c in enumerate(scored["completions"]) if (b, r) not in replayed_rows)
        replayed_calls += sum(tool_messages(scored["completions"][r]) for bb, r in replayed_rows if bb == b)
        assert calls_per_batch[b] == fresh, b
    assert replayed_calls > 0
    return calls_per_batch


@pytest.mark.parametrize("tools", [[add, mul], [async_add, mul]], ids=["sync", "async"])
def test_train_with_tools(tmp_path, tools):
    # TRL's test_train_with_tools: a multiply/add tool, called by some rollouts; here with replay firing.
    branches = ASYNC_ADD_OR_MUL if tools[0] is async_add else None
    trainer = train(tmp_path, tools=tools, branches=branches)
    check_replay(trainer, f"tools ({'async' if branches else 'sync'})")
    calls_per_batch = check_tools_not_rerun(trainer)
    # TRL's own metric counts the calls it ran per row, as for GRPOTrainer
    history = [h for h in trainer.state.log_history if "loss" in h]
    for h, scored, calls in zip(history, trainer.scored, calls_per_batch):
        assert h["tools/call_frequency"] == pytest.approx(calls / len(scored["completions"]))
        assert h["tools/failure_frequency"] == 0.0


def test_train_with_environment_factory(tmp_path):
    # TRL's test_train_with_environment_factory, with a train_dataset: each rollout's environment is reset from its
    # dataset row, and a replayed question's fresh rollouts are reset from that question's row.
    calculator, _, _, _ = env_classes()
    trainer = train(tmp_path, environment_factory=calculator, calls=lambda: len(calculator.calls))
    check_replay(trainer, "environment_factory")
    check_tools_not_rerun(trainer)
    n = len(trainer.scored[0]["completions"])
    assert len(calculator.resets) == n * len(trainer.batches)
    for b, batch in enumerate(trainer.batches):
        resets = calculator.resets[b * n : (b + 1) * n]
        assert [r["prompt"] for r in resets] == batch["prompts"]  # every row reset from the row it answers
        if batch["plan"] is not None:
            for j, g in enumerate(batch["plan"].group_indices):
                assert resets[g * K : (g + 1) * K] == [batch["plan"].rows[j]] * K
    # the replayed rows' environments were reset, never stepped (the pool's instances are reused: the last batch's)
    last = len(trainer.batches) - 1
    for b, _, row in replayed(trainer):
        if b == last:
            assert trainer.scored[b]["environments"][row].result is None


def test_train_with_multiple_environments(tmp_path):
    # TRL's test_train_with_multiple_environments: a dict environment_factory routes each row by its `environment`
    # column and exposes only that environment's tools (an adder with `add`, a multiplier with `mul`; calling the
    # other one fails).
    from datasets import concatenate_datasets

    _, _, adder, multiplier = env_classes()
    calls = lambda: len(adder.calls) + len(multiplier.calls)  # noqa: E731
    adds = calculator_dataset(16, "+").map(lambda row: {"environment": "adder"})
    muls = calculator_dataset(16, "*", start=16).map(lambda row: {"environment": "multiplier"})
    environments = {"adder": adder, "multiplier": multiplier}
    trainer = train(
        tmp_path, environment_factory=environments, dataset=concatenate_datasets([adds, muls]), calls=calls
    )
    check_replay(trainer, "environment_factory (dict)")
    check_tools_not_rerun(trainer)
    assert {c[1] for c in adder.calls} == {"add"} and {c[1] for c in multiplier.calls} == {"mul"}
    # each environment reset from its own rows (`environment` is TRL's control field, not passed to reset())
    assert adder.resets and all("+" in r["prompt"][0]["content"] and "environment" not in r for r in adder.resets)
    assert multiplier.resets and all("*" in r["prompt"][0]["content"] for r in multiplier.resets)
    replayed_environments = set()
    for b, j, row in replayed(trainer):
        plan = trainer.batches[b]["plan"]
        name = plan.rows[j]["environment"]
        replayed_environments.add(name)
        assert all(type(e) is environments[name] for e in trainer.scored[b]["environments"][row : row + K])
        # reset() completed the prompt: the trajectory is scored under the prompt it was sampled with
        assert plan.record(j)["prompt"][0]["content"] == plan.rows[j]["prompt"][0]["content"] + f" {name[:3]}"
    assert replayed_environments == {"adder", "multiplier"}  # both kinds replayed
    assert trainer.rec["scoring"]  # candidates scored for entropy, each under its environment's prompt and tools
    for key, entry in trainer.exgrpo_state.buffer.questions.items():  # keyed by the dataset's prompt
        assert key == question_key(entry.row["prompt"])


def test_train_with_environment_owned_reward(tmp_path):
    # TRL's test_train_with_environment_owned_reward: no reward_funcs, the environment's get_reward() is the reward.
    # A replayed row's environment is only reset (its tool calls do not run again), so get_reward() on it reads an
    # untouched calculator (0.0): the reward its environment gave when the trajectory was stored (1.0) is used.
    _, scored_env, _, _ = env_classes()
    trainer = train(tmp_path, reward_funcs=[], environment_factory=scored_env)
    check_replay(trainer, "environment-owned reward")
    assert trainer.reward_func_names == ["Scored"]
    for b, j, row in replayed(trainer):
        assert trainer.batches[b]["plan"].record(j)["rewards"] == {"Scored": 1.0}
        assert trainer.scored[b]["rewards"][row, 0].item() == 1.0
        environment = trainer.scored[b]["environments"][row]
        if b == len(trainer.batches) - 1:  # the environments are reused: only the last batch's are as they ended
            assert environment.result is None and environment.get_reward() == 0.0
    replayed_rows = {(b, row) for b, _, row in replayed(trainer)}
    for b, scored in enumerate(trainer.scored):  # fresh rows: the environment's own verdict
        for r, (completion, row) in enumerate(zip(scored["completions"], scored["inputs"])):
            if (b, r) not in replayed_rows:
                solved = completion[-1]["content"] == row["answer"] and tool_messages(completion) > 0
                assert scored["rewards"][r, 0].item() == float(solved)


def test_train_with_malformed_and_failing_tool_calls(tmp_path):
    # TRL's test_train_with_malformed_tool_calls (a call without a tool name is parsed as text and runs nothing) and
    # the failing call of test_train_with_tools (a wrong argument name: the tool raises, TRL answers the error).
    config = {"max_completion_length": 80}  # room for the error message a failing call answers with
    trainer = train(tmp_path, tools=[add, mul], branches=GOOD_FAILING_OR_MALFORMED, max_steps=5, config=config)
    check_replay(trainer, "malformed and failing tool calls")
    tokenizer = trainer.processing_class
    malformed = failing = 0
    history = [h for h in trainer.state.log_history if "loss" in h]
    for h, scored in zip(history, trainer.scored):
        calls = fails = 0
        for ids, completion in zip(scored["completion_ids"], scored["completions"]):
            text = tokenizer.decode(ids)
            if text.startswith("<call>="):
                malformed += 1
                assert completion == [{"role": "assistant", "content": text.removesuffix("<eos>")}]
            elif text.startswith("<call>mul"):
                failing += 1
                assert "error" in completion[1]["content"] and completion[2]["content"] == ""
        replayed_rows = {r for bb, _, r in replayed(trainer) if trainer.scored[bb] is scored}
        for r, completion in enumerate(scored["completions"]):
            if r not in replayed_rows:
                calls += tool_messages(completion)
                fails += sum(1 for m in completion if m["role"] == "tool" and "error" in m["content"])
        assert h["tools/failure_frequency"] == pytest.approx(fails / calls if calls else 0.0)
    assert malformed and failing
    for t in trainer.exgrpo_state.buffer.iter_trajectories():  # only the good call solves
        assert tokenizer.decode(t.completion_ids.tolist()).startswith("<call>add")


def test_train_with_rollout_func(tmp_path):
    # TRL's rollout_func tests: the function produces every row (its own tool loop, the tool's answer masked by
    # env_mask, a per-row field `env_result` the reward reads); the stored trajectory then replaces its row, with its
    # env_mask and the field the function returned for it when it was stored.
    trainer = train(tmp_path, reward_funcs=rollout_reward, rollout_func=calculator_rollout)
    check_replay(trainer, "rollout_func")
    for b, j, row in replayed(trainer):
        plan, scored = trainer.batches[b]["plan"], trainer.scored[b]
        assert plan.record(j)["fields"] == {"env_result": plan.rows[j]["answer"]}
        assert scored["inputs"][row]["env_result"] == plan.rows[j]["answer"]
        assert scored["rewards"][row, 0].item() == 1.0
    # the buffer keeps the dataset row, not the fields the function added to it
    assert all(set(e.row) == {"prompt", "answer"} for e in trainer.exgrpo_state.buffer.questions.values())


# ------------------------------------------------------------------------------------------------ rejected
def test_environment_owned_data_is_rejected(tmp_path):
    calculator, _, adder, multiplier = env_classes()
    tokenizer = build_tool_tokenizer()
    args = ExGRPOConfig(**config_kwargs(tmp_path, max_steps=2))
    with pytest.raises(ValueError) as info:
        ExGRPOTrainer(  # by hand: no train_dataset at all, which make_trainer always gives
            model=make_tool_model(tokenizer),
            reward_funcs=calculator_reward,
            args=args,
            processing_class=tokenizer,
            environment_factory=calculator,
        )
    assert str(info.value) == ENVIRONMENT_OWNED_DATA and "\n" not in str(info.value)
    from datasets import Dataset

    routing_only = Dataset.from_dict({"environment": ["adder", "multiplier"] * 4})  # the environments pick questions
    with pytest.raises(ValueError, match="needs a train_dataset with a 'prompt' column"):
        make_trainer(
            tmp_path,
            tokenizer,
            model=make_tool_model(tokenizer),
            reward_funcs=calculator_reward,
            train_dataset=routing_only,
            trainer_kwargs={"environment_factory": {"adder": adder, "multiplier": multiplier}},
            max_steps=2,
        )


def test_image_inputs_with_tools_are_rejected(tmp_path, tokenizer):
    """Images train with replay (tests/trainer/test_vlm.py), but not beside tools: a tool's images are not stored."""
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": ["1+1="] * 8, "image": [None] * 8})
    with pytest.raises(NotImplementedError) as info:
        make_trainer(tmp_path, tokenizer, train_dataset=dataset, trainer_kwargs={"tools": [add]})
    assert str(info.value) == IMAGE_MULTI_TURN


# ------------------------------------------------------------------------------------------------ calculator task
def test_calculator_task_replays_tool_trajectories_and_resumes_bitwise(tmp_path):
    """The toy task that needs its tool (a guess, the only answer without one, never solves it), trained 24 steps
    with a checkpoint at 12, then 12 → 24 again from the checkpoint: the stored trajectories hold the tool's answer
    (masked out), replay fires, the model learns to call the right tool, and the resumed run ends bitwise equal."""
    import shutil

    from safetensors.numpy import load_file

    from exgrpo_trl.state_file import ARRAYS_FILENAME, META_FILENAME, STATE_DIRNAME, read_meta

    def run(out, resume=None):
        tokenizer = build_tool_tokenizer()
        trainer = make_trainer(
            out, tokenizer, cls=MultiTurnRecorder, model=make_tool_model(tokenizer), reward_funcs=calculator_reward,
            train_dataset=calculator_dataset(64), trainer_kwargs={"tools": [add, mul]}, max_steps=24,
            max_completion_length=32, learning_rate=1e-3, replay_start_pass_rate=0.0, save_strategy="steps",
            save_steps=12, per_device_train_batch_size=32,
        )  # fmt: skip
        with one_thread():
            trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "a")
    tokenizer = straight.processing_class
    REPLAYED_GROUPS["calculator task, 24 steps"] = len(replayed(straight))
    assert len(replayed(straight)) >= 30
    stored = list(straight.exgrpo_state.buffer.iter_trajectories())
    assert len(stored) >= 20
    for t in stored:  # every success went through the tool: its answer is in the trajectory, masked out
        assert t.mask is not None
        text, external = (tokenizer.decode(ids.tolist()) for ids in (t.completion_ids, t.completion_ids[t.mask == 0]))
        assert external == f"<tool>{_tool_answers(text)[0]}<bot>"
    assert straight.rec["scoring"]  # questions with two stored solutions: scored on their model tokens
    pass_at_1 = [h["exgrpo/batch/pass_at_1"] for h in straight.state.log_history if "loss" in h]
    assert np.mean(pass_at_1[-6:]) > np.mean(pass_at_1[:6]) + 0.1, pass_at_1  # it learns to call `add`

    checkpoint = tmp_path / "a" / "out" / "checkpoint-12"
    assert read_meta(checkpoint)["format_version"] == 2
    shutil.copytree(checkpoint, tmp_path / "b" / "out" / "checkpoint-12")
    resumed = run(tmp_path / "b", resume=str(tmp_path / "b" / "out" / "checkpoint-12"))
    assert resumed.rec["after_load"]["trajectories"] > 0
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name
    a_dir, b_dir = (tmp_path / x / "out/checkpoint-24" / STATE_DIRNAME for x in "ab")
    a, b = load_file(str(a_dir / ARRAYS_FILENAME)), load_file(str(b_dir / ARRAYS_FILENAME))
    assert "model_mask" in a and a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert (a_dir / META_FILENAME).read_bytes() == (b_dir / META_FILENAME).read_bytes()


# ------------------------------------------------------------------------------------------------ by hand
def _hand_trainer(tmp_path, **overrides):
    tokenizer = build_tool_tokenizer()
    trainer = make_trainer(
        tmp_path, tokenizer, model=make_tool_model(tokenizer), reward_funcs=calculator_reward,
        train_dataset=calculator_dataset(), trainer_kwargs={"tools": [add, mul]}, per_device_train_batch_size=2,
        num_generations=2, max_completion_length=6, **overrides,
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop otherwise
    return trainer, tokenizer


def test_replayed_row_with_tool_tokens_by_hand(tmp_path):
    """Row 0 is replayed: `<call>add a=3 b=4</call><eos><tool>7<bot>7<eos>`, truncated to its first 6 tokens for a
    short example, with tokens 2-3 marked as a tool's (tool_mask 0) and absurd behaviour log-probs there (-9: were
    they counted, w = exp(logp + 9) would dominate). Row 1 is fresh, 3 tokens, advantage -0.3.

    By hand, with dr_grpo (normaliser B x max_completion_length = 2 x 6 = 12), on-policy TRL (ratio 1, so a fresh
    token's loss is -A) and the replayed row's advantage 0.8 moved to the shaped term f(w) = w / (w + 0.1):
        loss = (-(-0.3) x 3 + sum over row 0's model tokens t in {0, 1, 4, 5} of -0.8 f(w_t)) / 12,
    w_t = exp(logp_t - behaviour_t), logp_t recomputed here from the model's logits. The gradient of the loss with
    respect to the tool tokens' log-probs is exactly 0; d loss / d logp_t = -0.8 x 0.1 w_t / (w_t + 0.1)^2 / 12 on
    row 0's model tokens (d f / d log w = gamma w / (w + gamma)^2), 0.3 / 12 on row 1's."""
    trainer, tokenizer = _hand_trainer(tmp_path)
    prompt = tokenizer("<user>3+4=<bot>", add_special_tokens=False)["input_ids"]  # 6 tokens
    completion = tokenizer("<call>add a", add_special_tokens=False)["input_ids"]  # 6 tokens
    fresh = tokenizer("01<eos>", add_special_tokens=False)["input_ids"] + [tokenizer.pad_token_id] * 3
    tool_mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]])
    behaviour = torch.tensor([[-2.0, -1.5, -9.0, -9.0, -2.5, -1.0], [0.0] * 6])
    inputs = {
        "prompt_ids": torch.tensor([prompt, prompt]),
        "prompt_mask": torch.ones(2, 6, dtype=torch.long),
        "completion_ids": torch.tensor([completion, fresh]),
        "completion_mask": torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]]),
        "tool_mask": tool_mask,
        "advantages": torch.tensor([0.8, -0.3]),
        "num_items_in_batch": torch.tensor(7),
        BatchKey.REPLAY_MASK: torch.tensor([True, False]),
        BatchKey.BEHAVIOUR_LOGPS: behaviour,
    }
    assert len(prompt) == len(completion) == 6
    fresh_tokens = 3

    captured = {}

    def keep_log_probs(module, args, output):  # TRL's fused LM head returns each position's next-token log-prob
        output.log_probs.retain_grad()
        captured["log_probs"] = output.log_probs

    handle = trainer.model.register_forward_hook(keep_log_probs)
    loss = trainer._compute_loss(trainer.model, inputs)
    handle.remove()
    loss.backward()

    with torch.no_grad():  # logp of each completion token, recomputed independently from the logits
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits = trainer.model(input_ids=ids, attention_mask=attention).logits[:, 5:-1]  # predict positions 6..11
        logp = torch.log_softmax(logits.float(), -1).gather(-1, inputs["completion_ids"][:, :, None])[..., 0]
    w = torch.exp(logp[0] - behaviour[0])
    f = w / (w + 0.1)
    model_tokens = [0, 1, 4, 5]
    expected = (0.3 * fresh_tokens - 0.8 * f[model_tokens].sum()) / 12
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)

    # d loss / d logp_t, on the log-probs of TRL's own forward pass (position 5 + t predicts completion token t)
    grad = captured["log_probs"].grad[:, 5:11]  # (2, 6)
    expected_grad = torch.zeros(2, 6)
    expected_grad[0, model_tokens] = -0.8 * 0.1 * w[model_tokens] / (w[model_tokens] + 0.1) ** 2 / 12
    expected_grad[1, :fresh_tokens] = 0.3 / 12  # the fresh row: TRL's -A / 12
    assert torch.equal(grad[0, 2:4], torch.zeros(2))  # the tool tokens: no gradient at all
    torch.testing.assert_close(grad, expected_grad, atol=1e-7, rtol=1e-4)


def test_entropy_score_of_a_row_with_tool_tokens_by_hand(tmp_path):
    """The entropy that selects a stored trajectory is the mean, over the model's tokens only, of the policy's
    entropy H_t = -sum_v p_t(v) log p_t(v) at each position, recomputed here from the model's logits."""
    trainer, tokenizer = _hand_trainer(tmp_path)
    trainer.model.eval()
    with torch.no_grad():  # embeddings (tied to the head) 5x wider than at initialisation, where every H_t ~ log V
        weight = trainer.model.get_input_embeddings().weight
        weight.copy_(0.1 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    prompt = tokenizer("<user>3+4=<bot>", add_special_tokens=False)["input_ids"]
    completion = tokenizer("<call>add a=3 b=4</call><eos><tool>7<bot>7<eos>", add_special_tokens=False)["input_ids"]
    mask = [1] * 14 + [0, 0, 0] + [1, 1]  # <tool>7<bot> is the tool's
    assert len(completion) == len(mask) == 19
    with torch.no_grad():
        logits = trainer.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)  # (19,)
    by_hand = entropy[torch.tensor(mask, dtype=torch.bool)].mean().item()
    scored = trainer._exgrpo_score_entropies([prompt, prompt], [completion, completion], [mask, None])
    assert scored[0].item() == pytest.approx(by_hand, abs=1e-5)
    assert scored[1].item() == pytest.approx(entropy.mean().item(), abs=1e-5)  # no mask: every token
    assert abs(scored[0].item() - scored[1].item()) > 1e-3, scored  # the tool tokens' entropies were left out
