"""Offline guidance's pure parts (algorithm §11), by hand: the cells a column may hold, which solution a question
gets, which rows get one, the state, and the shaped weight and loss of an offline token."""

from __future__ import annotations

import math

import pytest
import torch

from exgrpo_trl.loss import shaped_replay_token_loss
from exgrpo_trl.offline import OfflineGuide, offline_rows, offline_texts


def test_offline_texts_reads_text_messages_and_lists():
    assert offline_texts(None) == [] and offline_texts("") == [] and offline_texts([]) == []
    assert offline_texts("x = 2") == ["x = 2"]
    # TRL's conversational completion: a list of messages, the last one's content
    assert offline_texts([{"role": "assistant", "content": "x = 2"}]) == ["x = 2"]
    assert offline_texts(["a", [{"role": "assistant", "content": "b"}], "c"]) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="column target: expected a string"):
        offline_texts(3, "target")


def guide(rule="all_groups", max_length=4):
    # one token per character, then EOS (id 0)
    return OfflineGuide("solution", rule, max_length, lambda text: [ord(c) for c in text] + [0])


def test_the_first_usable_solution_is_chosen():
    g = guide()
    row = {"solution": ["toolong", "ab", "cd"]}
    # "toolong" is 8 tokens with EOS > 4: skipped (and noted); "ab" is 3 tokens: chosen
    assert g.solution("q", row) == (1, [97, 98, 0])
    assert g.too_long == {("q", 0)}
    g.rejected.add(("q", 1))  # the reward functions scored "ab" unsolved: the next one
    assert g.solution("q", row) == (2, [99, 100, 0])
    g.rejected.add(("q", 2))
    assert g.solution("q", row) is None
    assert g.solution("r", {"solution": []}) is None and g.solution("r", {}) is None


def test_unsolved_rule():
    g = guide("unsolved")
    row = {"solution": ["ab"]}
    assert g.solution("q", row) == (0, [97, 98, 0])
    g.self_solved.add("q")  # an on-policy success of q was stored
    assert g.solution("q", row) is None
    assert g.solution("r", row, retired={"r"}) is None  # retired: the model solves it K/K
    assert guide().solution("q", row, retired={"q"}) == (0, [97, 98, 0])  # LUFFY's rule does not look


def test_offline_rows_are_first_rows_of_fresh_groups():
    g = guide()
    # rank 1 of 2 holds global rows 8..15 with K = 4: groups 2 and 3 (first rows 8 and 12); group 3 is replayed
    inputs = [{"solution": ["ab"]}] * 8
    keys = [f"q{i // 4}" for i in range(8)]
    chosen = offline_rows(inputs, g, keys, replayed_groups=[3], process_index=1, k=4)
    assert list(chosen) == [0]
    row, ids = chosen[0]
    assert (row.key, row.index, row.global_row, ids) == ("q0", 0, 8, [97, 98, 0])


def test_state_round_trip():
    g = guide()
    g.rejected |= {("q", 1), ("a", 0)}
    g.self_solved |= {"z", "b"}
    state = g.state_dict()
    assert state == {"rejected": [["a", 0], ["q", 1]], "self_solved": ["b", "z"]}  # sorted, JSON
    h = guide()
    h.load_state_dict(state)
    assert (h.rejected, h.self_solved) == (g.rejected, g.self_solved)


def test_offline_token_weight_and_loss_by_hand():
    # behaviour log-prob 0 (probability 1): w = exp(logp_theta - 0) = pi_theta. With pi_theta = 0.5, gamma = 0.1:
    # f(w) = 0.5 / 0.6 = 0.8333..., loss = -f(w) * A = -1.6667 for A = 2, and d loss / d logp = -A * gamma * w /
    # (w + gamma)^2 = -2 * 0.1 * 0.5 / 0.36 = -0.2778.
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    loss, w, shaped = shaped_replay_token_loss(logp, torch.zeros(1, 1), torch.tensor([[2.0]]), gamma=0.1)
    assert w.item() == pytest.approx(0.5) and shaped.item() == pytest.approx(0.5 / 0.6)
    assert loss.item() == pytest.approx(-2 * 0.5 / 0.6)
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(-2 * 0.1 * 0.5 / 0.36)


def test_offline_verdicts_by_hand():
    from exgrpo_trl.offline import offline_verdicts

    # 8 global rows, K = 4: offline rows 0 (question a, solution 0) and 4 (question b, solution 1); row 0 solved,
    # row 4 not. Generated rows 1, 2, 3, 5, 6, 7 with successes 1, 0, 0, 1, 1, 0: Pass@1 3 / 6 = 0.5.
    solved = [True, True, False, False, False, True, True, False]
    verdicts = offline_verdicts([("a", 0, 0), ("b", 1, 4)], solved)
    assert (verdicts.unsolved, verdicts.rows, verdicts.pass_at_1) == ([("b", 1)], {0, 4}, 0.5)
    # every row offline: no generated row, Pass@1 0
    assert offline_verdicts([("a", 0, 0)], [True]).pass_at_1 == 0.0
