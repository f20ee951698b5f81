"""Pins the TRL 1.16 internals ExGRPOTrainer relies on, so that a TRL upgrade fails here, loudly."""

import inspect

import pytest
import trl
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer
from tests.helpers import config_kwargs, make_model, make_reward, make_trainer, synthetic_dataset


def params(fn):
    return list(inspect.signature(fn).parameters)


def test_trl_version_is_pinned():
    assert trl.__version__.startswith("1.16."), trl.__version__


def test_hook_signatures():
    assert params(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    assert params(GRPOTrainer._generate_single_turn) == [
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ]
    assert params(GRPOTrainer._calculate_rewards) == [
        "self",
        "inputs",
        "prompts",
        "completions",
        "completion_ids_list",
    ]
    assert params(GRPOTrainer._compute_loss) == ["self", "model", "inputs"]
    # TRL averages each list of `_metrics[mode]` into the row, then clears them (ExGRPO's gauges rely on both)
    assert params(GRPOTrainer.log) == ["self", "logs", "start_time"]
    source = inspect.getsource(GRPOTrainer.log)
    assert "self._metrics[mode].items()" in source and "self._metrics[mode].clear()" in source
    assert params(GRPOTrainer._get_per_token_logps_and_entropies)[:6] == [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
    ]
    assert "compute_entropy" in params(GRPOTrainer._get_per_token_logps_and_entropies)
    assert params(GRPOTrainer._get_train_sampler) == ["self", "dataset"]
    # `_run_epoch` tells the sampler the epoch it is called for (bound by name: transformers passes keywords)
    assert params(GRPOTrainer._run_epoch)[:3] == ["self", "model", "epoch"]
    assert params(GRPOTrainer._tokenize_prompts) == ["self", "prompts"]
    assert params(RepeatSampler.__init__) == [
        "self",
        "data_source",
        "mini_repeat_count",
        "batch_size",
        "repeat_count",
        "shuffle",
        "seed",
    ]
    init = params(GRPOTrainer.__init__)
    assert {"tools", "rollout_func", "environment_factory", "args", "train_dataset"} <= set(init)


def test_runtime_contract(tmp_path, tokenizer):
    """One real generation batch through the hooks: the attributes read and the keys TRL returns."""
    trainer = make_trainer(tmp_path, tokenizer, replay_start_pass_rate=0.0)
    for name in (
        "_step",
        "eos_token_ids",
        "_tokenizer",
        "reward_weights",
        "_metrics",
        "_pending_extra_logs",
        "num_generations",
        "loss_type",
        "max_completion_length",
        "_logs",
    ):
        assert hasattr(trainer, name), name
    sampler = GRPOTrainer._get_train_sampler(trainer)
    assert isinstance(sampler, RepeatSampler) and sampler.num_samples == 48 and sampler.batch_size == 4
    trainer.model.train()
    inputs = [{"prompt": p, "always": False} for p in synthetic_dataset()["prompt"][:4] for _ in range(8)]
    handed = []  # what the hooks handed on, as the run's `finish` receives it
    run = trainer.exgrpo_run
    original_finish = run.finish
    run.finish = lambda batch, output, **kw: handed.append(batch) or original_finish(batch, output, **kw)
    output = trainer._generate_and_score_completions(inputs)
    assert {
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "advantages",
        "num_items_in_batch",
    } <= set(output)
    assert output["advantages"].shape == (32,)
    (batch,) = handed
    assert batch.scored.rewards.shape == (32, 1)  # gathered over ranks: (N_global, num reward funcs)
    assert len(batch.scored.completion_ids) == 32
    assert run.open_batch is None  # closed once scored
    captured = []
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        captured.append(result)
        return result

    GRPOTrainer._get_per_token_logps_and_entropies = spy
    try:
        trainer.current_gradient_accumulation_steps = 1
        trainer._compute_loss(trainer.model, output)
    finally:
        GRPOTrainer._get_per_token_logps_and_entropies = original
    assert len(captured) == 1  # one policy forward per loss pass, which ExGRPO reuses
    assert captured[0][0].shape == output["completion_ids"].shape


def test_environment_owned_data_rejected(tmp_path, tokenizer):
    # tools, environments and rollout functions train (tests/trainer/test_multi_turn.py); an environment that picks
    # its own
    # questions (no train_dataset) cannot have a question replayed, and says so before TRL builds anything
    with pytest.raises(ValueError, match="needs a train_dataset with a 'prompt' column when environment_factory"):
        ExGRPOTrainer(  # by hand: no train_dataset at all, which make_trainer always gives
            model=make_model(tokenizer),
            reward_funcs=make_reward(tokenizer),
            args=ExGRPOConfig(**config_kwargs(tmp_path)),
            processing_class=tokenizer,
            environment_factory=object,
        )


def test_images_and_plain_grpo_config_rejected(tmp_path, tokenizer):
    from datasets import Dataset
    from trl import GRPOConfig

    with pytest.raises(NotImplementedError, match="image inputs has not been run with vLLM"):
        images = Dataset.from_dict({"prompt": ["a"], "image": [None]})
        make_trainer(tmp_path, tokenizer, train_dataset=images, use_vllm=True, vllm_mode="colocate")
    with pytest.raises(TypeError, match="needs an ExGRPOConfig, got a GRPOConfig"):
        ExGRPOTrainer(  # by hand: the mistake under test, a GRPOConfig, which make_trainer never pairs with it
            model=make_model(tokenizer),
            reward_funcs=make_reward(tokenizer),
            args=GRPOConfig(**config_kwargs(tmp_path)),
            processing_class=tokenizer,
            train_dataset=synthetic_dataset(),
        )


# Every private name of TRL's GRPOTrainer or transformers' Trainer the package touches, with the modules that touch it
# and how: "override" (a method ExGRPOTrainer overrides, always through super()), "call" (a private method it calls),
# "read" (an attribute it reads or writes), "swap" (an attribute `swapped` sets for one block), "keyword" (a private
# keyword argument). trainer.py is the one module that names any of them. Checked against TRL `CHECKED_AGAINST` (and
# the transformers it runs with): an upgrade that renames or drops one fails `test_private_names_exist` naming it,
# before any training run.
CHECKED_AGAINST = "1.16.0"
PRIVATE_NAMES = {
    "_generate_and_score_completions": ("trainer.py", "override"),
    "_generate_single_turn": ("trainer.py", "override"),
    "_tool_call_loop": ("trainer.py", "override"),
    "_generate": ("trainer.py", "override"),
    "_calculate_rewards": ("trainer.py", "override"),
    "_compute_loss": ("trainer.py", "override"),
    "_get_per_token_logps_and_entropies": ("trainer.py", "override"),
    "_get_train_sampler": ("trainer.py", "override"),
    "_save_checkpoint": ("trainer.py", "override"),
    "_load_optimizer_and_scheduler": ("trainer.py", "override"),
    "_issue_warnings_after_load": ("trainer.py", "override"),
    "_run_epoch": ("trainer.py", "override"),
    "_tokenize_prompts": ("trainer.py", "call"),
    "_get_output_dir": ("trainer.py", "call"),
    "_metrics": ("trainer.py", "read"),
    "_pending_extra_logs": ("trainer.py", "read"),
    "_step": ("trainer.py", "read"),
    "_tokenizer": ("trainer.py", "read"),
    "_is_vlm": ("trainer.py", "read"),
    "_multi_environment": ("trainer.py", "read"),
    "_tag_names": ("trainer.py", "read"),
    "_name": ("trainer.py", "read"),
    "_paper": ("trainer.py", "read"),
    "_batch_environments": ("trainer.py", "swap"),
    "_finish_current_push": ("trainer.py", "call"),
    "_internal_call": ("trainer.py", "keyword"),
}


def _trl_private_names() -> set[str]:
    """The private names GRPOTrainer and Trainer have: class attributes, attributes their code assigns on self, and
    their methods' keyword parameters."""
    import re

    import transformers
    import transformers.trainer
    import trl.trainer.grpo_trainer

    names = set(dir(GRPOTrainer)) | set(dir(transformers.Trainer))
    for module in (trl.trainer.grpo_trainer, transformers.trainer):
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*=", inspect.getsource(module)))
    for cls in (GRPOTrainer, transformers.Trainer):
        for _, fn in inspect.getmembers(cls, inspect.isfunction):
            names |= {p for p in inspect.signature(fn).parameters if p.startswith("_")}
    return {n for n in names if not n.startswith("__")}


def test_private_names_exist():
    assert trl.__version__.startswith(CHECKED_AGAINST.rsplit(".", 1)[0]), (trl.__version__, CHECKED_AGAINST)
    assert {where for where, _ in PRIVATE_NAMES.values()} == {"trainer.py"}  # the one module that names them
    missing = sorted(set(PRIVATE_NAMES) - _trl_private_names())
    assert not missing, f"TRL {trl.__version__} no longer has {missing}: ExGRPOTrainer relies on them"


def test_every_private_name_touched_is_pinned():
    """The package's source, read: every private name of GRPOTrainer / Trainer it overrides (trainer.py's `def`s),
    reads or calls (`._name`) or passes (`_name=`) is in PRIVATE_NAMES, in the module listed there. A module's own
    private helpers that happen to share a name with TRL's are left out (defined with `def` in that module)."""
    import re
    from pathlib import Path

    import exgrpo_trl

    package = Path(exgrpo_trl.__file__).parent
    trl_names = _trl_private_names()
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        text = path.read_text()
        own = set(re.findall(r"def (_[A-Za-z]\w*)", text)) if rel != "trainer.py" else set()
        names = set(re.findall(r"\.(_[A-Za-z]\w*)\b", text)) | set(re.findall(r"\b(_[A-Za-z]\w*)=", text))
        if rel == "trainer.py":
            names |= set(re.findall(r"def (_[A-Za-z]\w*)", text))
            names |= set(re.findall(r"^    (_[A-Za-z]\w*) =", text, re.M))  # class attributes (tags, name, paper)
        for name in (names & trl_names) - own:
            found.setdefault(name, set()).add(rel)
    pinned = {name: set(where.split()) for name, (where, _) in PRIVATE_NAMES.items()}
    assert found == pinned, (
        f"unpinned: { {n: w for n, w in found.items() if pinned.get(n) != w} }, "
        f"pinned but unused: {sorted(set(pinned) - set(found))}"
    )


# ------------------------------------------------------------------------------------------------ TRL's own unit tests
def _bare(cls):
    """A trainer built without __init__, as TRL's own unit tests build GRPOTrainer (`object.__new__` and the
    attributes `_generate` reads: TRL's TestGRPORolloutDispatch)."""
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    import torch

    trainer = object.__new__(cls)
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, gather=lambda t: t)
    trainer.args = SimpleNamespace(report_to=[])
    trainer.model = SimpleNamespace(training=True)
    trainer.state = SimpleNamespace(global_step=2, num_input_tokens_seen=0)
    trainer._last_loaded_step = 1
    trainer.use_vllm = False
    trainer.use_transformers_continuous_batching = False
    trainer.vllm_generation = SimpleNamespace(sync_weights=MagicMock())
    trainer.processing_class = SimpleNamespace(batch_decode=MagicMock(return_value=["decoded"]))
    trainer._tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    trainer.eos_token_ids = [2]
    trainer.tools = None
    trainer._metrics = {"train": __import__("collections").defaultdict(list)}
    return trainer


@pytest.mark.parametrize(
    "output",
    [
        {"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[-0.1]], "env_mask": [[1]]},
        {"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[0.0]]},
        {"prompt_ids": [[1]], "completion_ids": [[2]]},  # a required key missing: TRL's own error
    ],
    ids=["env_mask", "plain", "missing logprobs"],
)
def test_a_trainer_built_without_init_behaves_as_grpotrainer(output):
    """TRL's rollout-dispatch unit tests on a bare trainer: ExGRPOTrainer gives GRPOTrainer's result (or error), where
    it raised `no attribute exgrpo_run` before (its hooks read the run, which only __init__ builds)."""
    from unittest.mock import MagicMock

    results, metrics = [], []
    for cls in (GRPOTrainer, ExGRPOTrainer):
        trainer = _bare(cls)
        trainer.rollout_func = MagicMock(return_value=dict(output))
        try:
            results.append(trainer._generate(["prompt"]))
        except ValueError as error:
            results.append(str(error))
        trainer.rollout_func.assert_called_once_with(["prompt"], trainer)
        metrics.append(dict(trainer._metrics["train"]))
    assert results[0] == results[1] and metrics[0] == metrics[1]
    if "logprobs" not in output:
        assert results[1] == "rollout_func must return keys ['logprobs'] in its output dict."


def test_a_generate_that_ignores_the_row_count_is_told_in_one_line(tmp_path, tokenizer, monkeypatch):
    """A mocked `generate` that returns as many rows as a whole batch (TRL's tests mock it so), under replay: a
    replayed group generates K - 1 rows, so the mock's own concatenation fails; the trainer says why in one line.
    4 groups of K = 8: the first batch (32 rows, nothing replayed) trains; the second replays floor(0.5 x 4) = 2
    groups, so 30 rows are generated."""
    import torch
    from transformers.generation.utils import GenerationMixin

    eos = tokenizer.eos_token_id
    digit = tokenizer.convert_tokens_to_ids("1")

    def fake_generate(self, input_ids, **kwargs):  # 32 completions "1 1 <eos>", whatever it is given
        completions = torch.tensor([[digit, digit, eos]] * 32, device=input_ids.device)
        return torch.cat([input_ids, completions], dim=1)

    monkeypatch.setattr(GenerationMixin, "generate", fake_generate)

    def alternate(completion_ids, **kwargs):  # every other row solved: every group 4 of 8, stored and replayed
        return [float(i % 2) for i in range(len(completion_ids))]

    trainer = make_trainer(tmp_path, tokenizer, replay_start_pass_rate=0.0, max_steps=2, reward_funcs=alternate)
    with pytest.raises(RuntimeError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message and trainer.state.global_step == 1
    assert message.startswith("ExGRPO: the generation backend failed (RuntimeError: Sizes of tensors must match")
    assert "for 30 prompt rows (2 of this batch's 32 rows hold a stored trajectory" in message
