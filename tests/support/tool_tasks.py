"""Multi-turn stand-ins for the tests: a calculator task whose rollouts call tools, built locally.

- `build_tool_tokenizer`: one token per character of ``0-9 + * = space _ a b c d l m n s u y`` and per tag (``<user>``,
  ``<bot>``, ``<tool>``, ``<call>``, ``</call>``), with a prefix-preserving chat template that renders tool calls
  as ``<call>add a=3 b=4</call>`` and a response template TRL's `parse_response` reads them back with.
- `ToolCallingQwen2`: the tiny Qwen2 model whose `generate` samples from its own logits under a grammar
  (`CallGrammar`), so that every rollout is well formed and ends with EOS while the choices are the model's: answer
  at once (a guess starting with 0: never right) or call a tool, and which call (`branches`, e.g. ``add`` or
  ``mul``). After a tool's answer the model copies it (an error: it stops). TRL's real tool loop runs the calls.
- the task (`calculator_dataset`: "3+4=" -> "7", conversational), its tools (`add`, `mul`, `async_add`), reward
  (`calculator_reward`: the last message is the answer), environments (`CalculatorEnv` and kin, reset from the
  dataset row) and a rollout function (`calculator_rollout`: its own tool loop, the tool output masked by
  `env_mask`, the tool's answer returned as the per-row field `env_result`).

An untrained model calls a tool on about half of its rollouts and picks the right tool about half of the time, so a
group of 8 solves its question 1-7 times in most batches: successful multi-turn trajectories are stored from the
first batch and replayed from the next.
"""

from __future__ import annotations

import contextlib
import re

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.helpers import tiny_config

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
TAGS = ("<user>", "<bot>", "<tool>", "<call>", "</call>")
CHARS = tuple("0123456789+*= _abcdlmnsuy")
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<user>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<bot>{{ m.content }}"
    "{%- for tc in m.tool_calls or [] -%}<call>{{ tc.function.name }}"
    "{%- for k, v in tc.function.arguments.items() %} {{ k }}={{ v }}{%- endfor -%}</call>{%- endfor -%}<eos>"
    "{%- elif m.role == 'tool' -%}<tool>{{ m.content }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<bot>{%- endif -%}"
)
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<bot>",
    "fields": {
        "tool_calls": {
            "open_pattern": r"<call>(?P<name>[a-z_]+)",
            "close_pattern": r"</call>",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"(?P<key>[a-z]+)=(?P<value>\d+)", "value_parser": {"name": "json"}},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<eos>", "content": "text"},
    },
}
QUESTION = re.compile(r"(\d+)([+*])(\d+)=")


@contextlib.contextmanager
def one_thread():
    """One torch thread: these runs are tiny, and on a busy 2-core machine two threads made them 5x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + TAGS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"</?[a-z]+>|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=96,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


# ------------------------------------------------------------------------------------------------ generation
# The calls the model chooses between, token by token (two right ones, so a question has two distinct successes)
ADD_OR_MUL = ("add a={a} b={b}", "add b={b} a={a}", "mul a={a} b={b}")
ASYNC_ADD_OR_MUL = ("async_add a={a} b={b}", "async_add b={b} a={a}", "mul a={a} b={b}")
# a good call, a call with a wrong argument name (the tool fails) and a malformed one (no tool name: parsed as text)
GOOD_FAILING_OR_MALFORMED = ("add a={a} b={b}", "mul a={a} c={b}", "= a={a} b={b}")


class CallGrammar(LogitsProcessor):
    """Restricts each step's sampling to what the grammar allows; the model's own logits choose among the allowed.

    First turn: ``<call>`` or ``0`` (a guess: up to 3 more digits, then EOS); after ``<call>``, one of `branches` (the
    question's numbers put in), token by token: where branches part the model chooses, elsewhere the token is forced;
    then ``</call><eos>``. After a tool's answer (the prompt ends ``<tool>...<bot>``): the answer's digits, then EOS
    (EOS at once if it is not a number).
    """

    def __init__(self, tokenizer, branches):
        self.tokenizer, self.branches = tokenizer, branches
        self.vocab = tokenizer.get_vocab()
        self.digits = [self.vocab[d] for d in "0123456789"]
        self.prompt_length: int | None = None

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def allowed(self, prompt: list[int], generated: list[int]) -> list[int] | None:
        v, eos = self.vocab, self.vocab["<eos>"]
        if eos in generated:
            return None  # finished: generate pads it
        text = self.tokenizer.decode(prompt)
        turn = text[text.rfind("<bot>") :] if "<bot>" in text else ""
        before = text[: len(text) - len(turn)]
        if before.rfind("<tool>") > before.rfind("<eos>"):  # answering after a tool's answer
            result = before[before.rfind("<tool>") + len("<tool>") :]
            forced = (self._ids(result) if result.isdigit() else []) + [eos]
            return [forced[len(generated)]] if len(generated) < len(forced) else None
        if not generated:
            return [v["<call>"], v["0"]]
        if generated[0] == v["0"]:
            return self.digits + [eos] if len(generated) < 4 else [eos]
        match = QUESTION.search(text)
        a, b = (match.group(1), match.group(3)) if match else ("0", "0")
        calls = [self._ids(f"<call>{branch.format(a=a, b=b)}</call>") + [eos] for branch in self.branches]
        n = len(generated)
        return sorted({c[n] for c in calls if len(c) > n and c[:n] == generated}) or None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        pad = self.tokenizer.pad_token_id
        for i, row in enumerate(input_ids.tolist()):
            prompt = row[: self.prompt_length]
            start = next((j for j, t in enumerate(prompt) if t != pad), len(prompt))  # prompts are left-padded
            allowed = self.allowed(prompt[start:], row[self.prompt_length :])
            if allowed is not None:
                keep = scores[i, allowed].clone()
                scores[i] = -torch.inf
                scores[i, allowed] = keep
        return scores


class ToolCallingQwen2(Qwen2ForCausalLM):
    """The tiny model, generating under `CallGrammar` (`make_tool_model` sets `grammar_tokenizer` and `branches`)."""

    grammar_tokenizer = None
    branches = ADD_OR_MUL

    def generate(self, *args, **kwargs):
        kwargs["logits_processor"] = LogitsProcessorList([CallGrammar(self.grammar_tokenizer, self.branches)])
        return super().generate(*args, **kwargs)


def make_tool_model(tokenizer, seed: int = 0, branches=ADD_OR_MUL) -> ToolCallingQwen2:
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = tiny_config(Qwen2Config, tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         head_dim=32, max_position_embeddings=96, tie_word_embeddings=True)  # fmt: skip
    cls = type("ToolCallingQwen2", (ToolCallingQwen2,), {"grammar_tokenizer": tokenizer, "branches": branches})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, **ids)
    return model


# ------------------------------------------------------------------------------------------------ task
def calculator_dataset(n: int = 32, op: str = "+", start: int = 0) -> Dataset:
    """n questions "a+b=" (a, b in 1..9; or "a*b=") as one-message conversations, with their answers."""
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)][start : start + n]
    value = (lambda a, b: a + b) if op == "+" else (lambda a, b: a * b)
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{a}{op}{b}="}] for a, b in pairs],
            "answer": [str(value(a, b)) for a, b in pairs],
        }
    )


def final_answer(completion) -> str:
    """The text of a completion's last message after its last ``<bot>`` (a rollout function's completions are one
    message holding every turn)."""
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    return text[text.rfind("<bot>") + len("<bot>") :] if "<bot>" in text else text


def calculator_reward(completions, answer, **kwargs) -> list[float]:
    return [1.0 if final_answer(c) == a else 0.0 for c, a in zip(completions, answer)]


TOOL_CALLS: list[tuple[str, int, int]] = []  # every call of the standalone tools below: (name, a, b)


def add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum.
    """
    TOOL_CALLS.append(("add", a, b))
    return a + b


def mul(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    TOOL_CALLS.append(("mul", a, b))
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Adds two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum.
    """
    TOOL_CALLS.append(("async_add", a, b))
    return a + b


# ------------------------------------------------------------------------------------------------ environments
class CalculatorEnv:
    """One rollout's calculator: `reset(**row)` reads the question's answer; `add` and `mul` are its tools. Every
    call is appended to the class's `calls` (question answer, tool, a, b), every reset's kwargs to `resets`."""

    calls: list = []
    resets: list = []

    def reset(self, **row):
        type(self).resets.append(dict(row))
        self.answer, self.result = row.get("answer"), None

    def add(self, a: int, b: int) -> int:
        """
        Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum.
        """
        type(self).calls.append((self.answer, "add", a, b))
        self.result = a + b
        return self.result

    def mul(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product.
        """
        type(self).calls.append((self.answer, "mul", a, b))
        self.result = a * b
        return self.result


class ScoredCalculatorEnv(CalculatorEnv):
    """A calculator that owns its reward: 1.0 when its last result is the question's answer."""

    def get_reward(self) -> float:
        return 1.0 if self.result is not None and str(self.result) == self.answer else 0.0


def env_classes():
    """Fresh environment classes (their own `calls` and `resets` lists): a calculator, one that owns its reward, and
    an adder and a multiplier with one tool each (for a dict `environment_factory`)."""

    class Calculator(CalculatorEnv):
        calls, resets = [], []

    class Scored(ScoredCalculatorEnv):
        calls, resets = [], []

    class Adder:  # reset() completes the prompt, as TRL's environments may: "3+4=" becomes "3+4= add"
        calls, resets = [], []
        add = CalculatorEnv.add

        def reset(self, **row):
            CalculatorEnv.reset(self, **row)
            return " add"

    class Multiplier:
        calls, resets = [], []
        mul = CalculatorEnv.mul

        def reset(self, **row):
            CalculatorEnv.reset(self, **row)
            return " mul"

    return Calculator, Scored, Adder, Multiplier


# ------------------------------------------------------------------------------------------------ rollout function
def calculator_rollout(prompts, trainer):
    """A rollout function with its own tool loop: the model's first turn, the tool's answer ``<tool>R<bot>`` (masked
    out by `env_mask`), the model's second turn. Returns the tool's answer per row as the field `env_result`."""
    tokenizer, model = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.model)
    device = trainer.accelerator.device
    prompt_ids = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False) for p in prompts
    ]
    first = _generate(model, tokenizer, prompt_ids, trainer.generation_config, device)
    completion_ids, env_mask, env_result = [], [], []
    for prompt, turn in zip(prompt_ids, first):
        call = re.search(r"<call>([a-z]+) a=(\d+) b=(\d+)</call>", tokenizer.decode(turn))
        if call is None:
            completion_ids.append(turn)
            env_mask.append([1] * len(turn))
            env_result.append("")
            continue
        result = str({"add": add, "mul": mul}[call.group(1)](int(call.group(2)), int(call.group(3))))
        observation = tokenizer(f"<tool>{result}<bot>", add_special_tokens=False)["input_ids"]
        second = _generate(model, tokenizer, [prompt + turn + observation], trainer.generation_config, device)[0]
        completion_ids.append(turn + observation + second)
        env_mask.append([1] * len(turn) + [0] * len(observation) + [1] * len(second))
        env_result.append(result)
    logprobs = [[0.0] * len(ids) for ids in completion_ids]
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": logprobs,
        "env_mask": env_mask,
        "env_result": env_result,
    }


def _generate(model, tokenizer, prompt_ids, generation_config, device) -> list[list[int]]:
    """Sampled completions (up to and including EOS) of left-padded prompts."""
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompt_ids], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config)
    completions = []
    for row in out[:, width:].tolist():
        eos = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row) - 1
        completions.append(row[: eos + 1])
    return completions


def rollout_reward(completions, answer, env_result, **kwargs) -> list[float]:
    """Solved when the last turn is the answer and the tool said so (the field the rollout function returned)."""
    return [1.0 if final_answer(c) == a and r == a else 0.0 for c, a, r in zip(completions, answer, env_result)]
