"""The draw: every rule that decides what one generation batch replays, in one function and in order (algorithm
§5-6, §5a).

`draw` runs on every rank at the start of a generation batch, on the run's clock (generation batches made so far; a
trajectory's `collected_at` is the clock when it was stored, so its age is `clock - collected_at`):

1. **Eligibility** (the main process, which holds the buffer): with `replay_max_age` N, every stored trajectory older
   than N generation batches is dropped (neither replayed nor kept; a question left with none leaves the buffer);
   a question replayed in one of the last `replay_cooldown` batches sits out (the reuse limit). Retired questions are
   never in the buffer.
2. **The questions** (main): `replay_count` of them, by ExGRPO's Gaussian over the success buckets (or uniformly:
   `question_selection`), or, with `replay_priority="advantage"`, in proportion to the |advantage| TRL gave each
   question's latest stored success when it was collected, without replacement. The draw is closed on the buffer
   (`mark_replayed`) and each question's candidates shortlisted (`max_trajectory_candidates`, by stored likelihood;
   `random` picks its one here). The drawn questions go to every rank (`share`: one broadcast).
3. **The trajectories** (every rank): the candidates of every question with more than one are scored (`score`: mean
   entropy under the current policy; every rank runs the same forward passes) and the lowest kept
   (`trajectory_selection`).
4. **Use counts** (main): each chosen trajectory's `uses` goes up by one; with `replay_max_uses` N, one replayed N
   times leaves the buffer.

Every random choice comes from the buffer's own generator. No trl, transformers or accelerate imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .buffer import ExperienceBuffer, Trajectory, gaussian_bucket_probabilities, shortlist_candidates
from .replay import ReplayPlan, ReplayQuestion, replay_count
from .settings import ExGRPOSettings

# (rows, prompts, completion ids, masks) of every candidate to score -> their mean entropies, (N,)
Score = Callable[[list[dict], list[Any], list[Any], list[Any]], torch.Tensor]


def draw(
    buffer: ExperienceBuffer,
    settings: ExGRPOSettings,
    num_groups: int,
    clock: int,
    *,
    is_main_process: bool = True,
    share: Callable[[Any], Any] = lambda drawn: drawn,
    score: Score | None = None,
) -> ReplayPlan | None:
    """The plan of generation batch `clock` (of `num_groups` groups), every rule in order (module docstring); None
    when nothing is replayed. Every rank calls it at the same point: the main process draws (`buffer` is its buffer),
    `share` hands the drawn questions to every rank (a broadcast), and every rank scores and selects."""
    drawn = draw_questions(buffer, settings, num_groups, clock) if is_main_process else None
    drawn = share(drawn)
    if not drawn:
        return None
    scored = to_score(drawn, settings)
    entropies = torch.empty(0)
    if scored and score is not None:
        # each candidate under the prompt it was sampled with (an environment's reset() may have completed it)
        candidates = [(drawn[i].row, c) for i in scored for c in drawn[i].candidates]
        entropies = score(
            [row for row, _ in candidates],
            [(c.record or {}).get("prompt", row["prompt"]) for row, c in candidates],
            [c.completion_ids for _, c in candidates],
            [c.mask for _, c in candidates],  # None: every token is the model's (single-turn)
        )
    plan = select_trajectories(drawn, scored, entropies, settings, num_groups=num_groups, clock=clock)
    if is_main_process and plan.with_trajectories:
        count_uses(buffer, plan, settings)
    return plan


def draw_questions(
    buffer: ExperienceBuffer, settings: ExGRPOSettings, num_groups: int, clock: int
) -> list[ReplayQuestion]:
    """Steps 1-2 of `draw` on the buffer (the main process): the age limit applied, `replay_count` eligible questions
    chosen, the draw closed (`mark_replayed`: the reuse limit and the repeat flags, also when nothing is drawn), and
    each question's candidates shortlisted."""
    drop_old(buffer, settings, clock)
    keys = choose_questions(buffer, replay_count(buffer.num_questions, settings.replay_ratio, num_groups), clock)
    repeats = buffer.mark_replayed(keys, clock)
    return [_candidates(buffer, key, repeat, settings) for key, repeat in zip(keys, repeats)]


# ------------------------------------------------------------------------------------------------ 1. eligibility
def drop_old(buffer: ExperienceBuffer, settings: ExGRPOSettings, clock: int) -> int:
    """The age limit: drop every trajectory older than `replay_max_age` generation batches at `clock`; returns how
    many. Nothing without a limit."""
    limit = settings.replay_max_age
    if limit is None:
        return 0
    dropped = 0
    for key, entry in list(buffer.questions.items()):
        old = [t for t in entry.trajectories if clock - t.collected_at > limit]
        if old:
            buffer.drop_trajectories(key, old)
            dropped += len(old)
    return dropped


def eligible(buffer: ExperienceBuffer, key: str, clock: int) -> bool:
    """Whether `key` may be drawn in generation batch `clock`: always without a reuse limit; with one of N, unless it
    was replayed in one of the last N batches (replayed in batch b, it sits out batches b+1 .. b+N)."""
    last, limit = buffer.replayed_at.get(key), buffer.settings.replay_cooldown
    return limit == 0 or last is None or clock - last > limit


# ------------------------------------------------------------------------------------------------ 2. the questions
def choose_questions(buffer: ExperienceBuffer, n: int, clock: int) -> list[str]:
    """Draw `n` distinct eligible questions for generation batch `clock` (fewer if fewer are eligible), by the
    buffer's settings: the Gaussian over buckets (per-bucket counts from a capped multinomial, uniform within a
    bucket), uniform over the buffer, or in proportion to the |advantage| of each one's latest stored success."""
    settings = buffer.settings
    # without a reuse limit every question is eligible: the paper's draw, number for number
    members_of = {b: [q for q in m if eligible(buffer, q, clock)] for b, m in buffer._buckets.items()}
    n = min(int(n), sum(len(m) for m in members_of.values()))
    if n <= 0:
        return []
    if settings.replay_priority == "advantage" or settings.question_selection == "uniform":  # over the questions
        keys = [q for q in buffer.questions if eligible(buffer, q, clock)]
        p = None  # uniform
        if settings.replay_priority == "advantage":
            weights = np.array([question_priority(buffer, q) for q in keys], dtype=np.float64)
            if np.count_nonzero(weights) < n:  # too few weighted: the rest uniformly among the others
                weights = np.where(weights > 0, weights, weights[weights > 0].min() if weights.any() else 1.0)
            p = weights / weights.sum()
        return [keys[i] for i in buffer.rng.choice(len(keys), size=n, replace=False, p=p)]

    buckets = [b for b, members in members_of.items() if members]
    probs = gaussian_bucket_probabilities(buckets, buffer.num_generations, settings.replay_mu, settings.replay_sigma)
    p = np.array([probs[b] for b in buckets], dtype=np.float64)
    sizes = np.array([len(members_of[b]) for b in buckets], dtype=np.int64)
    counts = _capped_multinomial(buffer.rng, n, p, sizes)
    sampled: list[str] = []
    for bucket, count in zip(buckets, counts):
        if count:
            members = members_of[bucket]
            sampled += [members[i] for i in buffer.rng.choice(len(members), size=int(count), replace=False)]
    return sampled


def question_priority(buffer: ExperienceBuffer, key: str) -> float:
    """A question's weight under `replay_priority="advantage"`: |advantage| of its latest stored success (the last
    one stored); a trajectory stored without one (seeded from an export, or from an older state) counts as a success
    of its question's bucket k under unscaled rewards, 1 - k / K."""
    entry = buffer.questions[key]
    latest = entry.trajectories[-1].advantage
    return abs(latest) if latest is not None else 1.0 - entry.k / buffer.num_generations


def _capped_multinomial(rng: np.random.Generator, n: int, p: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Multinomial counts over buckets, none above its bucket's size: the excess is redrawn among buckets with room."""
    counts = np.zeros_like(sizes)
    remaining = n
    probs = p.copy()
    while remaining > 0:
        room = sizes - counts
        probs = np.where(room > 0, probs, 0.0)
        if probs.sum() <= 0:  # only zero-weight buckets have room: spread over them uniformly
            probs = (room > 0).astype(np.float64)
        draw = rng.multinomial(remaining, probs / probs.sum())
        counts = counts + np.minimum(draw, room)
        remaining = int(n - counts.sum())
    return counts


def _candidates(buffer: ExperienceBuffer, key: str, repeat: bool, settings: ExGRPOSettings) -> ReplayQuestion:
    """A drawn question with the stored trajectories offered for selection (algorithm §6): `random` draws its one
    here, uniformly over all stored ones; the other rules keep at most the settings' cap, ranked by stored
    log-likelihood (`shortlist_candidates`)."""
    entry = buffer.questions[key]
    candidates: Sequence[Trajectory] = entry.trajectories
    if settings.trajectory_selection == "random":
        if len(candidates) > 1:
            candidates = [candidates[buffer.choose_random(len(candidates))]]
    else:
        cap = settings.max_trajectory_candidates
        candidates = shortlist_candidates(candidates, cap, settings.trajectory_selection == "highest_entropy")
    return ReplayQuestion(key, entry.row, list(candidates), entry.k, repeat)


# ------------------------------------------------------------------------------------------------ 3. trajectories
def select_lowest(scores: torch.Tensor, highest: bool = False) -> int:
    """Index of the lowest score (`highest=True`: the highest); the first one on ties, as `argmin` does."""
    return int(torch.argmin(-scores if highest else scores))


def to_score(drawn: Sequence[ReplayQuestion], settings: ExGRPOSettings) -> list[int]:
    """The drawn questions whose candidates are scored (entropy under the current policy): those with more than one,
    unless the settings select at random or put no stored trajectory in the group."""
    if settings.trajectory_selection == "random" or not settings.replay_stored_trajectory:
        return []
    return [i for i, question in enumerate(drawn) if len(question.candidates) > 1]


def select_trajectories(
    drawn: Sequence[ReplayQuestion],
    scored: Sequence[int],
    entropies: torch.Tensor,
    settings: ExGRPOSettings,
    *,
    num_groups: int,
    clock: int,
) -> ReplayPlan:
    """The plan of generation batch `clock` (of `num_groups` groups): each drawn question with its chosen candidate,
    the lowest (or highest) mean entropy among its candidates for the `scored` ones (algorithm §6), the first for the
    others. `entropies`: the scored questions' candidates' entropies, concatenated in their order."""
    chosen, selected, start = [0] * len(drawn), [], 0
    for i in scored:
        scores = entropies[start : start + len(drawn[i].candidates)]
        chosen[i] = select_lowest(scores, highest=settings.trajectory_selection == "highest_entropy")
        selected.append(float(scores[chosen[i]]))
        start += len(drawn[i].candidates)
    return ReplayPlan.build(drawn, chosen, num_groups, clock, selected, settings.replay_stored_trajectory)


# ------------------------------------------------------------------------------------------------ 4. use counts
def count_uses(buffer: ExperienceBuffer, plan: ReplayPlan, settings: ExGRPOSettings) -> None:
    """Each trajectory the plan replays is used once more (the main process's buffer: the plan's trajectories came to
    the other ranks by broadcast, as copies); with `replay_max_uses` N, one used N times leaves the buffer."""
    for question, chosen in zip(plan.questions, plan.trajectories):
        entry = buffer.questions.get(question.key)
        if entry is None:
            continue
        stored = next((t for t in entry.trajectories if t is chosen), None)  # the buffer's own object on the main
        if stored is None:  # a copy (a broadcast that pickles on its source too): the stored one with its tokens
            stored = next((t for t in entry.trajectories if np.array_equal(t.completion_ids, chosen.completion_ids)
                           and t.collected_at == chosen.collected_at), None)  # fmt: skip
        if stored is None:
            continue
        stored.uses += 1
        limit = settings.replay_max_uses
        if limit is not None and stored.uses >= limit:
            buffer.drop_trajectories(question.key, [stored])
