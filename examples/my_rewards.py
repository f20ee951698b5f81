import re


def boxed_reward(completions, answer, **kwargs):
    """1.0 when the last \\boxed{...} of a completion is the reference answer, else 0.0."""
    rewards = []
    for completion, reference in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion  # chat or plain text
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
        rewards.append(1.0 if boxed and boxed[-1].strip() == str(reference).strip() else 0.0)
    return rewards


def think_format_reward(completions, **kwargs):
    """0.1 for a completion that closes its reasoning with </think>: never 'solved' on its own (0.1 < 1.0)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [0.1 if "</think>" in text else 0.0 for text in texts]
