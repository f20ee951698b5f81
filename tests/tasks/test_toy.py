"""Unit tests of the toy task (exgrpo_trl.tasks.toy): tokenizer, reward, data, tiny model, warm start, evaluation,
the command line."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from datasets import Dataset

from exgrpo_trl.tasks import toy
from exgrpo_trl.tasks.toy import (
    addition_dataset,
    addition_reward,
    addition_splits,
    build_char_tokenizer,
    build_tiny_model,
    build_tiny_model_dir,
    evaluate_pass_at_1,
    load_char_tokenizer,
    warm_start,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models gain little from threads, and a multi-threaded step is many times slower whenever another
    # process is busy on the machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_vocab_and_specials(tokenizer):
    assert len(tokenizer) == 16
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.unk_token_id) == (
        0,
        1,
        2,
        3,
    )
    assert tokenizer.padding_side == "left"


def test_tokenizer_round_trip_exact(tokenizer):
    ids = tokenizer("37+48=85")["input_ids"]
    # specials take 0-3, then "0".."9" -> 4..13, "+" -> 14, "=" -> 15; no special token added.
    assert ids == [7, 11, 14, 8, 12, 15, 12, 9]
    assert tokenizer.batch_decode([ids]) == ["37+48=85"]  # no spaces between characters
    assert tokenizer.decode(ids + [tokenizer.eos_token_id, 0, 0], skip_special_tokens=True) == "37+48=85"
    assert tokenizer("7<eos>")["input_ids"] == [11, 1]
    assert tokenizer("7x")["input_ids"] == [11, 3]  # unknown character -> <unk>


def test_tokenizer_left_padding(tokenizer):
    batch = tokenizer(["1+1=", "12+34="], padding=True)
    assert batch["input_ids"] == [[0, 0, 5, 14, 5, 15], [5, 6, 14, 7, 8, 15]]
    assert batch["attention_mask"] == [[0, 0, 1, 1, 1, 1], [1] * 6]


def test_tokenizer_save_and_load(tmp_path, tokenizer):
    build_char_tokenizer(save_dir=tmp_path)
    loaded = load_char_tokenizer(tmp_path)
    assert loaded("9999+1=10000")["input_ids"] == tokenizer("9999+1=10000")["input_ids"]
    assert loaded.batch_decode([loaded("9999+1=10000")["input_ids"]]) == ["9999+1=10000"]
    assert loaded.padding_side == "left" and loaded.pad_token == "<pad>" and loaded.eos_token == "<eos>"


def test_tokenizer_grown_to_a_real_vocabulary_size(tokenizer):
    # 16 base tokens + fillers <f0> .. <f495> at ids 16 .. 511; encoding keeps the base ids and never yields a filler
    big = build_char_tokenizer(vocab_size=512)
    assert len(big) == 512 and big.convert_ids_to_tokens([15, 16, 511]) == ["=", "<f0>", "<f495>"]
    assert big("37+48=85")["input_ids"] == tokenizer("37+48=85")["input_ids"]
    assert big("<f0>")["input_ids"] == [3, 3, 4, 3]  # "<", "f", "0", ">": characters, not the filler
    assert big.decode([11, 16, 1], skip_special_tokens=True) == "7<f0>"
    assert len(build_char_tokenizer(vocab_size=16)) == 16
    with pytest.raises(ValueError, match="vocab_size must be at least 16"):
        build_char_tokenizer(vocab_size=15)


# ---------------------------------------------------------------- reward
def test_reward_hand_cases():
    completions = ["85", " 85", "85\n", "86", "", "850", "8 5", "085"]
    assert addition_reward(completions, ["85"] * len(completions)) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert addition_reward(["0"], ["0"]) == [1.0]
    # conversational completions: the last message's content is scored
    assert addition_reward([[{"role": "assistant", "content": "12"}]], ["12"]) == [1.0]


def test_reward_ignores_extra_columns_and_logs_by_digits():
    logged = []
    rewards = addition_reward(
        ["3", "4", "12", "99", "100"],
        answer=["3", "3", "12", "12", "100"],
        digits=[1, 1, 2, 2, 2],
        prompt=["1+2="] * 5,
        trainer_state=None,
        log_metric=lambda name, value: logged.append((name, value)),
    )
    assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert logged == [("accuracy/digits_1", 0.5), ("accuracy/digits_2", pytest.approx(2 / 3, abs=1e-12))]


def test_reward_without_log_metric_logs_nothing():
    assert addition_reward(["5"], ["5"], digits=[1]) == [1.0]


# ---------------------------------------------------------------- data
def _check_rows(ds):
    for p, a, d in zip(ds["prompt"], ds["answer"], ds["digits"]):
        x, y = p[:-1].split("+")
        assert p.endswith("=")
        assert int(x) + int(y) == int(a) and a == str(int(a))
        assert len(x) == len(y) == d
        if d > 1:
            assert x[0] != "0" and y[0] != "0"


def test_dataset_columns_uniqueness_and_spread():
    ds = addition_dataset(400, seed=3)
    assert ds.column_names == ["prompt", "answer", "digits"]
    assert len(ds) == 400 and len(set(ds["prompt"])) == 400
    _check_rows(ds)
    counts = Counter(ds["digits"])
    assert set(counts) == {1, 2, 3, 4}
    # uniform over 4 classes: 100 each, binomial sd ~8.7; 60..140 is more than 4 sd either way
    assert all(60 <= c <= 140 for c in counts.values()), counts
    assert addition_dataset(400, seed=3)["prompt"] == ds["prompt"]  # deterministic from the seed
    assert addition_dataset(400, seed=4)["prompt"] != ds["prompt"]


def test_dataset_digit_range_and_exhaustion():
    one = addition_dataset(100, min_digits=1, max_digits=1, seed=0)
    assert sorted(one["prompt"]) == sorted(f"{a}+{b}=" for a in range(10) for b in range(10))
    with pytest.raises(ValueError):
        addition_dataset(101, min_digits=1, max_digits=1)
    excluded = {"1+2=", "3+4="}
    rest = addition_dataset(98, min_digits=1, max_digits=1, exclude=excluded)
    assert not excluded & set(rest["prompt"])
    with pytest.raises(ValueError):
        addition_dataset(99, min_digits=1, max_digits=1, exclude=excluded)
    # once the 100 one-digit questions are used up, the draws go to the other class
    mixed = addition_dataset(400, min_digits=1, max_digits=2, seed=0)
    assert Counter(mixed["digits"]) == {1: 100, 2: 300}
    _check_rows(mixed)
    three = addition_dataset(50, min_digits=3, max_digits=3, seed=1)
    assert set(three["digits"]) == {3}
    _check_rows(three)


def test_splits_disjoint():
    train, eval_ = addition_splits(600, 120, seed=0)
    assert len(train) == 600 and len(eval_) == 120
    assert not set(train["prompt"]) & set(eval_["prompt"])
    assert len(set(train["prompt"])) == 600 and len(set(eval_["prompt"])) == 120
    assert set(eval_["digits"]) == {1, 2, 3, 4}


# ---------------------------------------------------------------- model
def _expected_params(vocab, h, layers, inter):
    # q, k, v with bias (kv heads = heads), o without bias, 3 MLP matrices, 2 RMSNorms per layer;
    # tied embedding counted once, final norm.
    per_layer = 3 * (h * h + h) + h * h + 3 * h * inter + 2 * h
    return vocab * h + layers * per_layer + h


def test_model_shape_and_param_count(tokenizer):
    model = build_tiny_model(tokenizer)
    n = sum(p.numel() for p in model.parameters())
    assert n == _expected_params(16, 128, 4, 512) == 1_053_312
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.head_dim == 64 and model.config.num_attention_heads == 2
    assert model.dtype == torch.float32
    gc = model.generation_config
    assert (gc.eos_token_id, gc.pad_token_id, gc.bos_token_id) == (1, 0, 2)
    small = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128)
    assert sum(p.numel() for p in small.parameters()) == _expected_params(16, 64, 2, 128)


def test_model_deterministic_and_rng_untouched(tokenizer):
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    a = build_tiny_model(tokenizer, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = build_tiny_model(tokenizer, seed=7)
    c = build_tiny_model(tokenizer, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_model_dir_loads_with_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    build_tiny_model_dir(tmp_path, hidden_size=64, num_layers=1, num_heads=1, intermediate_size=64, seed=3)
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    ref = build_tiny_model(tok, hidden_size=64, num_layers=1, num_heads=1, intermediate_size=64, seed=3)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert tok.batch_decode([tok("12+3=15")["input_ids"]]) == ["12+3=15"]


def test_module_cli_writes_model_and_jsonl(tmp_path, capsys):
    assert toy.main(["--out", str(tmp_path), "--n-train", "40", "--n-eval", "12", "--no-progress"]) == 0
    # it says the pass@1 the folder's model reached, held-out and on the training file's mix, and what the latter
    # means for a delayed start (an untrained model: 0, below the paper's 0.35)
    held_out, last = capsys.readouterr().out.splitlines()[-2:]
    assert held_out.startswith("held-out pass@1 0.000 (") and "12 questions, balanced" in held_out, held_out
    assert last.startswith("training-mix pass@1 0.000 (") and "not above the paper's delayed start 0.35" in last, last
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    eval_ = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(train) == 40 and len(eval_) == 12
    assert set(train[0]) == {"prompt", "answer", "digits"}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    assert (tmp_path / "config.json").is_file() and (tmp_path / "tokenizer.json").is_file()


# ---------------------------------------------------------------- warm start
def test_supervised_batch_masks_prompt_and_padding(tokenizer):
    import random

    batch = toy._supervised_batch(tokenizer, random.Random(0), 8, 1, 4)
    for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
        text = tokenizer.decode(ids[mask.bool()])
        prompt, answer = text.split("=")
        assert answer.endswith("<eos>")
        n_label = int((labels != -100).sum())
        assert n_label == len(answer) - len("<eos>") + 1  # answer digits + <eos>
        assert labels[-1].item() == tokenizer.eos_token_id
        assert (labels[~mask.bool()] == -100).all()


def test_warm_start_lowers_loss(tokenizer):
    model = build_tiny_model(tokenizer, seed=0)
    model.eval()
    info = warm_start(model, tokenizer, steps=30, batch_size=64, warmup=5, progress=False)
    losses = info["losses"]
    assert len(losses) == 30 and info["steps"] == 30
    # ln(16) = 2.77 at random init; 30 steps should take the answer loss well below 2.3
    assert sum(losses[:3]) / 3 > 2.5
    assert sum(losses[-5:]) / 5 < 2.3
    assert not model.training  # mode restored


# ---------------------------------------------------------------- evaluation
class _ScriptedModel(torch.nn.Module):
    """A stand-in for a causal LM whose `generate` answers each prompt correctly in a scripted number of samples."""

    def __init__(self, tokenizer, correct_of):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.tok = tokenizer
        self.correct_of = correct_of  # prompt -> how many of the samples are correct

    def generate(self, input_ids, attention_mask, num_return_sequences, max_new_tokens, **kwargs):
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            assert mask[-1] == 1  # left padding: the prompt ends at the right edge
            prompt = self.tok.decode(ids[mask.bool()])
            x, y = prompt[:-1].split("+")
            answer = str(int(x) + int(y))
            for j in range(num_return_sequences):
                text = answer if j < self.correct_of[prompt] else answer + "1"
                new = self.tok(text)["input_ids"] + [self.tok.eos_token_id]
                new = (new + [self.tok.pad_token_id] * max_new_tokens)[:max_new_tokens]
                rows.append(ids.tolist() + new)
        return torch.tensor(rows)


def test_evaluate_pass_at_1_aggregates_exactly(tokenizer):
    ds = Dataset.from_dict(
        {
            "prompt": ["1+2=", "3+4=", "12+34=", "99+99=", "1234+5678="],
            "answer": ["3", "7", "46", "198", "6912"],
            "digits": [1, 1, 2, 2, 4],
        }
    )
    correct = {"1+2=": 4, "3+4=": 2, "12+34=": 1, "99+99=": 0, "1234+5678=": 3}
    model = _ScriptedModel(tokenizer, correct)
    model.train()
    res = evaluate_pass_at_1(model, tokenizer, ds, samples=4, batch_size=8, progress=False)
    assert res["per_question"] == [1.0, 0.5, 0.25, 0.0, 0.75]
    assert res["by_digits"] == {1: 0.75, 2: 0.125, 4: 0.75}
    assert res["overall"] == pytest.approx(2.5 / 5, abs=1e-12)
    assert model.training  # mode restored


def test_evaluate_pass_at_1_real_model_seeded(tokenizer):
    model = build_tiny_model(tokenizer, seed=0)
    model.eval()
    ds = addition_dataset(12, seed=5)
    torch.manual_seed(99)
    state = torch.random.get_rng_state()
    a = evaluate_pass_at_1(model, tokenizer, ds, samples=4, seed=3, progress=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert set(a) == {"overall", "by_digits", "per_question"}
    assert len(a["per_question"]) == 12
    assert all(p in (0.0, 0.25, 0.5, 0.75, 1.0) for p in a["per_question"])
    assert 0.0 <= a["overall"] <= 1.0 and set(a["by_digits"]) == set(ds["digits"])
    assert (
        a["per_question"]
        == evaluate_pass_at_1(model, tokenizer, ds, samples=4, seed=3, progress=False)["per_question"]
    )
    assert not model.training


# ---------------------------------------------------------------- other tasks leave addition unchanged
def test_char_tokenizer_alphabet_argument():
    tok = build_char_tokenizer(alphabet=toy.ALPHABET + ("-",))
    assert len(tok) == 17 and tok("9-1=8")["input_ids"] == [13, 16, 5, 15, 12]
    for bad in (("1", "1"), ("ab",)):
        with pytest.raises(ValueError):
            build_char_tokenizer(alphabet=bad)


def test_pass_at_1_line_by_hand():
    above = toy.pass_at_1_line({"overall": 0.5, "by_digits": {1: 0.9, 2: 0.1}, "per_question": [0.9, 0.1]})
    assert above == (
        "training-mix pass@1 0.500 (1 digit 0.90, 2 digits 0.10; the first 2 questions of train.jsonl, 8 samples "
        "each; what the delayed start reads): above the paper's delayed start 0.35: with it, replay switches on "
        "within the first batches"
    )
    below = toy.pass_at_1_line({"overall": 0.35, "by_digits": {}, "per_question": []})  # not above
    assert "replay_start_pass_rate: 0, as recipes/tiny_cpu.yaml does" in below


def test_the_builder_judges_the_delayed_start_on_the_training_mix(tmp_path, capsys):
    """The training file leans to 3- and 4-digit sums (there are only 100 one-digit sums, and the held-out file takes
    its share first), while eval.jsonl is balanced; the delayed start reads training batches. The builder's verdict
    used to come from the balanced held-out set (0.39 there, 0.19-0.29 in training batches)."""
    from collections import Counter

    train, eval_ = toy.addition_splits(2000, 200, seed=0)
    assert Counter(train["digits"]) == {1: 48, 2: 629, 3: 644, 4: 679}  # the recipe's train.jsonl
    assert Counter(eval_["digits"]) == {1: 52, 2: 44, 3: 55, 4: 49}  # uniform draws over the digit classes
    mix = toy.training_mix(train)
    assert mix["prompt"] == train["prompt"][: toy.TRAINING_MIX_QUESTIONS]
    assert Counter(mix["digits"])[1] < Counter(mix["digits"])[4]  # the file's lean, not the held-out balance
    assert toy.main(["--out", str(tmp_path / "toy"), "--n-train", "40", "--n-eval", "8", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("held-out pass@1 ") and "8 questions, balanced" in lines[-2]
    assert lines[-1].startswith("training-mix pass@1 ") and "the first 40 questions of train.jsonl" in lines[-1]
