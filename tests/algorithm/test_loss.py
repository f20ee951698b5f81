"""Shaped replay loss and its gradient against hand-computed values; TRL-equal aggregation (algorithm §8)."""

import math

import pytest
import torch

from exgrpo_trl.loss import aggregate_token_loss, shaped_replay_token_loss

GAMMA = 0.1
BEHAVIOUR = -1.0
A = 2.0


def loss_and_grad(w: float, *, gamma, importance_correction=True, advantage=A):
    logp = torch.tensor([[BEHAVIOUR + math.log(w)]], dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([[BEHAVIOUR]], dtype=torch.float64)
    loss, weight, shaped = shaped_replay_token_loss(
        logp,
        behaviour,
        torch.tensor([[advantage]], dtype=torch.float64),
        gamma=gamma,
        importance_correction=importance_correction,
    )
    loss.sum().backward()
    return loss.item(), logp.grad.item(), weight.item(), shaped.item()


# f(w) = w / (w + .1); loss = -f(w) * A; d loss / d logp = -A * gamma * w / (w + gamma)^2 (dw/dlogp = w).
#   w = .01: f = .01/.11 = .0909091, loss = -.181818, grad = -2 * .001 / .0121   = -.165289
#   w = 1:   f = 1/1.1   = .909091,  loss = -1.818182, grad = -2 * .1 / 1.21     = -.165289
#   w = 10:  f = 10/10.1 = .990099,  loss = -1.980198, grad = -2 * 1 / 102.01    = -.0196059
@pytest.mark.parametrize(
    "w, loss, grad, shaped",
    [
        (0.01, -0.181818, -0.165289, 0.0909091),
        (1.0, -1.818182, -0.165289, 0.909091),
        (10.0, -1.980198, -0.0196059, 0.990099),
    ],
)
def test_shaped_loss_and_gradient(w, loss, grad, shaped):
    got = loss_and_grad(w, gamma=GAMMA)
    assert got[0] == pytest.approx(loss, abs=1e-6)
    assert got[1] == pytest.approx(grad, abs=1e-6)
    assert got[2] == pytest.approx(w, rel=1e-9)
    assert got[3] == pytest.approx(shaped, abs=1e-6)


# Without shaping (gamma=None): loss = -w * A, grad = -w * A: w = .01 -> -.02; 1 -> -2; 10 -> -20.
@pytest.mark.parametrize("w", [0.01, 1.0, 10.0])
def test_no_shaping_is_the_plain_ratio(w):
    loss, grad, _, shaped = loss_and_grad(w, gamma=None)
    assert loss == pytest.approx(-w * A, rel=1e-9)
    assert grad == pytest.approx(-w * A, rel=1e-9)
    assert shaped == pytest.approx(w, rel=1e-9)


# Without IS correction the behaviour log-prob is the current one, detached: w = 1 in value whatever the stored
# log-prob, so with shaping loss = -A / 1.1 = -1.818182 and grad = -A * .1 / 1.21 = -.165289 for every w; without
# shaping as well, it is on-policy REINFORCE: loss = -A = -2, grad = -2.
@pytest.mark.parametrize("w", [0.01, 1.0, 10.0])
def test_no_importance_correction(w):
    loss, grad, weight, _ = loss_and_grad(w, gamma=GAMMA, importance_correction=False)
    assert (loss, grad, weight) == pytest.approx((-1.818182, -0.165289, 1.0), abs=1e-6)
    loss, grad, _, _ = loss_and_grad(w, gamma=None, importance_correction=False)
    assert (loss, grad) == pytest.approx((-2.0, -2.0), abs=1e-12)


def test_negative_advantage_and_no_overflow():
    # A = -1, w = 1: loss = +1/1.1 = .909091, grad = +.1/1.21 = .0826446
    loss, grad, _, _ = loss_and_grad(1.0, gamma=GAMMA, advantage=-1.0)
    assert (loss, grad) == pytest.approx((0.909091, 0.0826446), abs=1e-6)
    # log w = 1000 would overflow exp(); the shaped weight saturates at 1 with a zero gradient instead of NaN.
    logp = torch.tensor([[1000.0]], requires_grad=True)
    loss, _, shaped = shaped_replay_token_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), gamma=GAMMA)
    loss.sum().backward()
    assert loss.item() == -1.0 and shaped.item() == 1.0 and logp.grad.item() == 0.0


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])  # the 100 is masked out
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


# Row sums 6 and 9 over 3 and 2 tokens; 15 over 5 tokens; GA = 2.
@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", (6 / 3 + 9 / 2) / 2 / 2),  # mean of per-row means, / GA = 1.625
        ("sapo", (6 / 3 + 9 / 2) / 2 / 2),
        ("bnpo", 15 / 5 / 2),  # 1.5
        ("dr_grpo", 15 / (2 * 4) / 2),  # B * max_completion_length = 8 -> .9375
        ("dapo", 15 / (20 / 2 * 2 / 4)),  # num_items / processes * GA / steps_per_generation = 5 -> 3
        ("cispo", 15 / 5),
        ("vespo", 15 / 5),
        ("luspo", (6 + 9) / 2 / 2),  # mean of row sums / GA = 3.75
    ],
)
def test_aggregation_matches_trl_normalisers(loss_type, expected):
    got = aggregate_token_loss(
        PER_TOKEN,
        MASK,
        loss_type=loss_type,
        max_completion_length=4,
        num_items_in_batch=torch.tensor(20.0),
        num_processes=2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
    )
    assert got.item() == pytest.approx(expected, abs=1e-7)


def test_aggregation_rejects_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_token_loss(
            PER_TOKEN,
            MASK,
            loss_type="ppo",
            max_completion_length=4,
            num_items_in_batch=None,
            num_processes=1,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
        )


def test_replay_token_stats_by_hand():
    from exgrpo_trl.loss import ReplayTokenStats

    # One rank, two rows of 3 tokens. Row 0 replayed (mask 1 1 0), row 1 offline (mask 1 0 0).
    # w = [[0.05, 2.0, 9.0], [0.5, 7.0, 7.0]], f(w) given; gamma 0.1.
    # replayed tokens: w 0.05, 2.0 -> sum 2.05, max 2.0, count 2, below gamma 1; f 0.3 + 0.9 = 1.2
    # offline tokens: w 0.5, f 0.8 -> sums 0.5, 0.8, count 1
    w = torch.tensor([[0.05, 2.0, 9.0], [0.5, 7.0, 7.0]])
    shaped = torch.tensor([[0.3, 0.9, 1.0], [0.8, 1.0, 1.0]])
    token_mask = torch.tensor([[True, True, False], [False, False, False]])
    offline_mask = torch.tensor([[False, False, False], [True, False, False]])
    stats = ReplayTokenStats.of(w, shaped, token_mask, offline_mask, torch.tensor(-0.25), 0.1)
    row = stats.as_row()
    assert row.tolist() == pytest.approx([2.05, 1.2, 2.0, 2.0, -0.25, 1.0, 0.5, 0.8, 1.0])
    # A second rank with no replayed or offline token: counts 0, max 0, loss 0.75. Over the two ranks:
    # is_weight_mean 2.05 / 2, shaped 1.2 / 2, max 2.0, below gamma 1 / 2, loss (-0.25 + 0.75) / 2 = 0.25,
    # offline token prob 0.5 / 1, shaped 0.8 / 1
    empty = ReplayTokenStats.of(w, shaped, torch.zeros_like(token_mask), torch.zeros_like(offline_mask),
                                torch.tensor(0.75), 0.1)  # fmt: skip
    figures = ReplayTokenStats.figures(torch.stack([row, empty.as_row()]), 0.1)
    assert figures == pytest.approx({
        "offline/token_prob_mean": 0.5, "offline/shaped_weight_mean": 0.8, "replay/is_weight_mean": 1.025,
        "replay/is_weight_max": 2.0, "replay/shaped_weight_mean": 0.6, "replay/is_weight_below_gamma": 0.5,
        "replay/loss": 0.25,
    })  # fmt: skip
    assert list(figures)[:2] == ["offline/token_prob_mean", "offline/shaped_weight_mean"]
    # no replayed or offline token anywhere, no shaping: only the loss is logged
    none = ReplayTokenStats.of(w, shaped, torch.zeros_like(token_mask), None, torch.tensor(0.5), None)
    assert ReplayTokenStats.figures(none.as_row().unsqueeze(0), None) == {"replay/loss": 0.5}
