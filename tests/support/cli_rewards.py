"""Reward functions for the `exgrpo train` tests, named in a recipe as ``tests.support.cli_rewards:NAME``."""

from __future__ import annotations

import os
import select
import signal
import stat
import sys
import time

from exgrpo_trl.tasks.toy import addition_reward

EOS_ID = 1  # of the char tokenizer (exgrpo_trl.tasks.toy: <pad>, <eos>, <bos>, <unk>, then the alphabet)

_calls = 0


def broken_reward(completions, answer, **kwargs):
    """A reward function with a bug: it reads a column the dataset does not have."""
    return [float(row["answer_typo"]) for row in kwargs["rows"]]


def interrupting_reward(completions, answer, **kwargs):
    """The toy reward, but on call EXGRPO_TEST_INTERRUPT_AT the process gets SIGINT, as from Ctrl-C in its terminal.
    With EXGRPO_TEST_INTERRUPT_GROUP=1 the whole process group gets it, as a terminal sends it to every process of
    the command line it runs (`exgrpo train ... | tee log`: tee dies of it), and the reward returns once its stdout
    has no reader left, when it is a pipe: the next write to it is the one a dead `| tee` breaks."""
    global _calls
    _calls += 1
    if _calls == int(os.environ.get("EXGRPO_TEST_INTERRUPT_AT", "0")):
        if os.environ.get("EXGRPO_TEST_INTERRUPT_GROUP") == "1":
            os.killpg(os.getpgrp(), signal.SIGINT)
            _wait_for_no_reader(sys.stdout.fileno())
        else:
            os.kill(os.getpid(), signal.SIGINT)
    return addition_reward(completions, answer, **kwargs)


def _wait_for_no_reader(fd: int, timeout: float = 60.0) -> None:
    """Until the pipe `fd` writes to has no reader (poll's POLLERR on a pipe's writing end), at most `timeout` s."""
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        return
    poller = select.poll()
    poller.register(fd, select.POLLERR)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not poller.poll(100):
        pass


def short_completion_reward(completion_ids, **kwargs):
    """Solved when the completion ends within 6 tokens: about half of an untrained model's rollouts (as the tests'
    synthetic reward), so the advantages are not all 0 and an adapter moves away from the identity."""
    return [1.0 if EOS_ID in ids and len(ids) <= 6 else 0.0 for ids in completion_ids]


def short_or_always_reward(completion_ids, prompts, **kwargs):
    """`short_completion_reward`, and every completion of a question whose prompt starts with "1" solved: those
    questions retire the first time they are trained fresh (K/K), and the sampler skips them from the next epoch."""
    short = short_completion_reward(completion_ids)
    return [1.0 if str(p).startswith("1") else s for p, s in zip(prompts, short)]


def filling_reward(completions, answer, **kwargs):
    """The toy reward; on call EXGRPO_TEST_FILL_AT it fills the filesystem of the folder EXGRPO_TEST_FILL_DIR with a
    file `filler` until EXGRPO_TEST_FILL_LEAVE bytes are left (default 0): the next save finds the disk full."""
    global _calls
    _calls += 1
    if _calls == int(os.environ.get("EXGRPO_TEST_FILL_AT", "0")):
        folder = os.environ["EXGRPO_TEST_FILL_DIR"]
        leave = int(os.environ.get("EXGRPO_TEST_FILL_LEAVE", "0"))
        with open(os.path.join(folder, "filler"), "wb") as f:
            chunk = b"\0" * (1 << 16)
            while (free := os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize) > leave:
                try:
                    f.write(chunk[: max(1, min(len(chunk), free - leave))])
                    f.flush()
                except OSError:
                    break
    return addition_reward(completions, answer, **kwargs)
