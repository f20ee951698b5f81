"""The experience buffer of ExGRPO (algorithm §2-5): successful trajectories keyed by question, success buckets, the
retired set, and the bucket sampler.

This module knows nothing of the training loop: no trl, transformers or accelerate imports. It stores plain arrays
and Python values so it can be unit-tested with lists and saved without pickle.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .settings import ExGRPOSettings, sampling_settings

# Token ids as int32 and behaviour log-probs as float16: 6 bytes per stored token. float16 keeps a log-prob to
# about 3 significant digits (|error| <= 5e-4 * |logp|), i.e. an importance weight to 0.05% for a token of
# log-prob -1, far below the step-to-step drift the weight measures.
IDS_DTYPE = np.int32
LOGPS_DTYPE = np.float16
# Which tokens of a multi-turn completion the model produced (1) and which a tool or an environment inserted (0):
# one byte per token, kept only for trajectories that hold external tokens (None: every token is the model's).
MASK_DTYPE = np.uint8
# The concentration of replay (`ExperienceBuffer.reuse`) is read over this many generation batches: long enough that
# a reuse limit of N < 49 still leaves room for a question to come back (at most ceil(50 / (N + 1)) times), so the
# figure means the same with or without a limit.
REUSE_WINDOW = 50
# What the buffer's clock counts (saved with the state; states without it counted draws and stamped trajectories with
# the optimizer step: `restore` converts them).
CLOCK = "generation_batches"


def image_digest(image: Any) -> str:
    """A stable identity for one image: a hash of its pixels (mode, size and raw bytes of a PIL image), or of its
    encoded bytes (a `datasets` Image cell that is not decoded: {"bytes": ..., "path": ...}). Never its repr, which
    holds a memory address."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(image, dict) and image.get("bytes") is not None:
        h.update(b"encoded:" + bytes(image["bytes"]))
    elif hasattr(image, "tobytes") and hasattr(image, "mode") and hasattr(image, "size"):
        h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode() + image.tobytes())
    else:
        raise TypeError(f"an image must be a PIL image or an encoded image cell, got {type(image).__name__}")
    return h.hexdigest()


def _plain(value: Any) -> str:
    """A prompt's value JSON cannot hold, for its key: an image inside the messages by its pixels, else its text."""
    try:
        return image_digest(value)
    except TypeError:
        return str(value)


IMAGE_COLUMNS = ("images", "image")  # the dataset columns TRL reads a row's images from, in its order


def has_images(columns) -> bool:
    """Whether a dataset with these column names holds image inputs."""
    return any(c in columns for c in IMAGE_COLUMNS)


def row_images(row: dict[str, Any]) -> list[Any]:
    """The images of a dataset row as TRL reads them: its `images` list, else its `image` (none: [])."""
    images = row.get("images")
    if images:
        return list(images)
    return [row["image"]] if row.get("image") is not None else []


def question_key(prompt: Any, images: Sequence[Any] = ()) -> str:
    """A stable identity for a question: a hash of its prompt (a string or a list of chat messages) and of its images'
    pixels, in order (`image_digest`): the same text over two images is two questions. Without images the key is the
    prompt's alone, as before images were supported (states saved then keep their keys)."""
    if isinstance(prompt, str):
        text = prompt
    else:
        text = json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=_plain)
    if images:
        text += "\x00images:" + ",".join(image_digest(image) for image in images)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def row_key(row: dict[str, Any]) -> str:
    """The key of the question a dataset row asks (`question_key` of its prompt and images)."""
    return question_key(row["prompt"], row_images(row))


def gaussian_bucket_probabilities(
    nonempty_buckets: Iterable[int], num_generations: int, mu: float = 0.5, sigma: float = 1.0
) -> dict[int, float]:
    """P(bucket k) proportional to N(k; mu * K, sigma) over the non-empty buckets only (algorithm §5).

    The density is taken on the success-count scale (as the reference code does): with K = 8, mu = 0.5, sigma = 1
    and all buckets non-empty this is {1: .0044, 2: .0540, 3: .2420, 4: .3990, 5: .2420, 6: .0540, 7: .0044}.
    A bucket's probability does not depend on how many questions it holds.
    """
    buckets = sorted(set(nonempty_buckets))
    if not buckets:
        return {}
    centre = mu * num_generations
    weights = [math.exp(-0.5 * ((k - centre) / sigma) ** 2) for k in buckets]
    total = sum(weights)
    if total == 0.0:  # every bucket is many sigmas away: fall back to the nearest bucket(s)
        distance = [abs(k - centre) for k in buckets]
        weights = [1.0 if d == min(distance) else 0.0 for d in distance]
        total = sum(weights)
    return {k: w / total for k, w in zip(buckets, weights)}


def shortlist_indices(stored_nll: Sequence[float], m: int | None, highest: bool = False) -> list[int]:
    """Indices (ascending) of the `m` lowest stored NLLs (`highest=True`: the `m` highest), ties to the later index.

    With `m` None, or no more values than `m`, every index."""
    n = len(stored_nll)
    if m is None or n <= m:
        return list(range(n))
    sign = -1.0 if highest else 1.0
    ranked = sorted(range(n), key=lambda i: (sign * float(stored_nll[i]), -i))
    return sorted(ranked[:m])


def shortlist_candidates(trajectories: Sequence[Trajectory], m: int | None, highest: bool = False) -> list[Trajectory]:
    """The `m` stored trajectories to score for selection (the settings' cap on candidates), in stored order.

    A trajectory's stored negative log-likelihood, the mean of -logp over its tokens under the policy that sampled
    it, estimates its per-token entropy at collection time and costs no forward pass. The shortlist is the `m`
    lowest (`highest=True`: the `m` highest, for highest-entropy selection), ties going to the more recently stored.
    With `m` None, or no more trajectories than `m`, every trajectory is a candidate.
    """
    if m is None or len(trajectories) <= m:
        return list(trajectories)
    nll = [t.stored_nll() for t in trajectories]
    return [trajectories[i] for i in shortlist_indices(nll, m, highest)]


@dataclass(slots=True)
class Trajectory:
    """One stored successful completion: its token ids and the behaviour policy's per-token log-probs.

    A multi-turn completion (tool calls, environment observations) also keeps `mask`, 1 where the model produced the
    token and 0 where a tool or environment inserted it, and `record`, what the reward functions were given for it
    beyond its token ids (JSON-able: the message list with its tool calls, environment-owned rewards, a rollout
    function's per-row fields, the prompt an environment completed), so that a replay reproduces it without running
    a tool or an environment again."""

    completion_ids: np.ndarray  # (L,) int32, ends with EOS
    logps: np.ndarray  # (L,) float16, log-probs under the policy that generated it (before its update)
    collected_at: int  # the run's clock (generation batches made so far) when it was collected
    mask: np.ndarray | None = None  # (L,) uint8, 1 for the model's tokens; None: all of them (normalised so)
    record: dict[str, Any] | None = None
    advantage: float | None = None  # the advantage TRL gave it when collected (None: seeded, or an older state)
    uses: int = 0  # times it has been replayed

    def stored_nll(self) -> float:
        """Mean -logp over the model's tokens under the policy that sampled it (no forward pass)."""
        logps = self.logps if self.mask is None else self.logps[self.mask.astype(bool)]
        return -float(np.mean(logps, dtype=np.float64))

    def model_mask(self) -> np.ndarray:
        """(L,) uint8: 1 where the model produced the token (all ones for a single-turn completion)."""
        return np.ones_like(self.completion_ids, dtype=MASK_DTYPE) if self.mask is None else self.mask

    def __post_init__(self):
        self.completion_ids = np.ascontiguousarray(self.completion_ids, dtype=IDS_DTYPE)
        self.logps = np.ascontiguousarray(self.logps, dtype=LOGPS_DTYPE)
        if self.completion_ids.ndim != 1 or self.completion_ids.shape != self.logps.shape:
            raise ValueError(
                f"a trajectory needs 1-D token ids and log-probs of the same length, got shapes "
                f"{self.completion_ids.shape} and {self.logps.shape}"
            )
        if self.mask is not None:
            mask = np.ascontiguousarray(self.mask, dtype=MASK_DTYPE)
            if mask.shape != self.completion_ids.shape or (mask > 1).any():
                raise ValueError(f"a trajectory's model mask must be 0/1 of shape {self.completion_ids.shape}")
            self.mask = None if mask.all() else mask


@dataclass(slots=True)
class QuestionEntry:
    """A question in the buffer: the dataset row to re-score it with, its latest success count, its trajectories."""

    row: dict[str, Any]
    k: int
    trajectories: list[Trajectory] = field(default_factory=list)


class ExperienceBuffer:
    """Successful trajectories keyed by question, bucketed by each question's latest success count k in 1..K-1.

    - `update_group` applies one group's outcome: K/K retires the question (removed, never replayed again), 0/K
      leaves an existing entry as it is, 1..K-1 sets the bucket and adds the new, de-duplicated trajectories.
    - What is replayed is decided in one place, `draw.draw` (every rule in order); the buffer holds what it reads:
      the buckets, when each question was last replayed (`mark_replayed` closes a draw) and each trajectory's stamp,
      advantage and use count. `drop_trajectories` removes what the age limit or the use cap retires.
    - Time is the run's clock, in generation batches, handed in by the caller (`clock`): the reuse limit, the repeat
      flags and `reuse` count in it, and trajectories are stamped with it (`Trajectory.collected_at`).
    - All randomness comes from the buffer's own seeded generator, never the global torch / numpy / python ones.

    `settings`: the run's `ExGRPOSettings` (the sampling ones are read: `settings.sampling_settings`); the paper's
    defaults when None.
    """

    def __init__(self, num_generations: int, settings: ExGRPOSettings | None = None, *, seed: int = 0):
        if num_generations < 2:
            raise ValueError(f"num_generations must be >= 2, got {num_generations}")
        self.num_generations = num_generations
        self.settings = ExGRPOSettings() if settings is None else settings
        self.seed = seed
        self.replayed_at: dict[str, int] = {}  # question -> the generation batch it was last replayed in
        # (generation batch, the questions replayed in it) of the last REUSE_WINDOW batches: what `reuse` reads
        self.recent: collections.deque[tuple[int, list[str]]] = collections.deque()
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.questions: dict[str, QuestionEntry] = {}  # insertion-ordered: sampling is reproducible
        self.retired: set[str] = set()
        # bucket k -> its questions (a dict used as an ordered set), kept in step with `questions`
        self._buckets: dict[int, dict[str, None]] = {k: {} for k in range(1, num_generations)}

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        return len(self.questions)

    def __contains__(self, key: str) -> bool:
        return key in self.questions

    @property
    def num_questions(self) -> int:
        return len(self.questions)

    @property
    def num_trajectories(self) -> int:
        return sum(len(entry.trajectories) for entry in self.questions.values())

    @property
    def num_tokens(self) -> int:
        return sum(t.completion_ids.size for entry in self.questions.values() for t in entry.trajectories)

    def bucket_counts(self) -> dict[int, int]:
        """Number of questions per bucket k = 1..K-1 (empty buckets included, as 0)."""
        return {k: len(members) for k, members in self._buckets.items()}

    def _set_bucket(self, key: str, entry: QuestionEntry, k: int) -> None:
        self._buckets[entry.k].pop(key, None)
        entry.k = k
        self._buckets[k][key] = None

    # ------------------------------------------------------------------ collection
    def retire(self, key: str) -> None:
        """Permanently retire a question (algorithm §4): it leaves the buffer and is never replayed again."""
        entry = self.questions.pop(key, None)
        if entry is not None:
            self._buckets[entry.k].pop(key, None)
        self.replayed_at.pop(key, None)
        self.retired.add(key)

    def update_group(
        self,
        key: str,
        k: int,
        row: dict[str, Any] | None = None,
        trajectories: Sequence[Trajectory] = (),
    ) -> int:
        """Apply the outcome of one group (k successes out of K) for question `key`. Returns #trajectories added."""
        if not 0 <= k <= self.num_generations:
            raise ValueError(f"success count must be in [0, {self.num_generations}], got {k}")
        if k == self.num_generations:
            self.retire(key)
            return 0
        if k == 0 or key in self.retired:
            return 0
        entry = self.questions.get(key)
        if entry is None:
            if not trajectories:
                return 0  # a question enters the buffer with its first stored trajectory
            if row is None:
                raise ValueError(f"a new question ({key}) needs its dataset row to be stored")
            entry = self.questions[key] = QuestionEntry(row=dict(row), k=k)
        self._set_bucket(key, entry, k)
        added = 0
        for trajectory in trajectories:
            if not any(_same_ids(trajectory.completion_ids, t.completion_ids) for t in entry.trajectories):
                entry.trajectories.append(trajectory)
                added += 1
        return added

    # ------------------------------------------------------------------ sampling
    def bucket_probabilities(self) -> dict[int, float]:
        counts = self.bucket_counts()
        s = self.settings
        return gaussian_bucket_probabilities(
            [k for k, c in counts.items() if c > 0], self.num_generations, s.replay_mu, s.replay_sigma
        )

    def mark_replayed(self, keys: Sequence[str], clock: int) -> list[bool]:
        """Close the draw of generation batch `clock`: `keys` were replayed in it. Returns, per key, whether it was
        also replayed in the batch before (the repeat share's numerator); the reuse limit counts from here."""
        repeats = [self.replayed_at.get(key) == clock - 1 for key in keys]
        for key in keys:
            if key in self.questions:
                self.replayed_at[key] = clock
        self.recent.append((clock, list(keys)))
        while self.recent and clock - self.recent[0][0] >= REUSE_WINDOW:
            self.recent.popleft()
        return repeats

    def drop_trajectories(self, key: str, dropped: Sequence[Trajectory]) -> None:
        """Remove `dropped` (by identity) from question `key`'s trajectories; a question left with none leaves the
        buffer (not retired: it comes back with its next stored success). The age limit and the use cap call it."""
        entry = self.questions.get(key)
        if entry is None:
            return
        ids = {id(t) for t in dropped}
        entry.trajectories = [t for t in entry.trajectories if id(t) not in ids]
        if not entry.trajectories:
            del self.questions[key]
            self._buckets[entry.k].pop(key, None)

    def reuse(self) -> float | None:
        """Replays per distinct replayed question over the last `REUSE_WINDOW` generation batches: 1.0 when no question
        came back, up to the window's length when the same questions are drawn every batch (None: nothing replayed in
        it). A reuse limit of N caps it at ceil(REUSE_WINDOW / (N + 1)); unlike the repeat share it is not 0 by
        construction then."""
        replays = sum(len(keys) for _, keys in self.recent)
        distinct = len({key for _, keys in self.recent for key in keys})
        return replays / distinct if distinct else None

    def choose_random(self, n: int) -> int:
        """Index of one of `n` candidates, uniformly, from the buffer's generator (random trajectory selection)."""
        return int(self.rng.integers(n))

    # ------------------------------------------------------------------ state
    def config_dict(self) -> dict[str, Any]:
        """K, the seed and the sampling settings, under the keys the saved state keeps them (`sampling_settings`)."""
        sampling = {key: getattr(self.settings, name) for name, (key, _) in sampling_settings().items()}
        return {"num_generations": self.num_generations, **sampling, "seed": self.seed}

    def iter_trajectories(self) -> Iterator[Trajectory]:
        """Every stored trajectory in saved order: questions in buffer order, trajectories in stored order."""
        for entry in self.questions.values():
            yield from entry.trajectories

    def state_meta(self) -> dict[str, Any]:
        """The JSON-able part of the state: the config, the sampler's random generator state, the questions (key,
        bucket, dataset row, number of trajectories) and the retired set."""
        # A question moves to the end of its bucket whenever its bucket is set, and sampling draws by position in the
        # bucket: the positions are state too, or a resumed run would draw different questions.
        position = {key: i for members in self._buckets.values() for i, key in enumerate(members)}
        return {
            "config": self.config_dict(),
            "rng_state": self.rng.bit_generator.state,
            "questions": [
                {
                    "key": key,
                    "k": e.k,
                    "num_trajectories": len(e.trajectories),
                    "bucket_position": position[key],
                    "row": e.row,
                    # multi-turn trajectories only (state format 2): what the reward functions saw of each
                    **({"records": [t.record for t in e.trajectories]} if _has_records(e) else {}),
                    # per trajectory, when any has one: the advantage it was collected with, and its replays
                    **(
                        {"advantages": [t.advantage for t in e.trajectories]}
                        if any(t.advantage is not None for t in e.trajectories)
                        else {}
                    ),
                    **({"uses": [t.uses for t in e.trajectories]} if any(t.uses for t in e.trajectories) else {}),
                }
                for key, e in self.questions.items()
            ],
            "retired": sorted(self.retired),
            # when questions were replayed, in generation batches (`mark_replayed`), kept with or without a reuse
            # limit: the repeat share and `reuse` read them
            "clock": CLOCK,
            "replayed_at": dict(self.replayed_at),
            "recent": [[at, list(keys)] for at, keys in self.recent],
        }

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The whole buffer as flat arrays (for safetensors) and JSON-able metadata; no pickle anywhere.

        Arrays: every stored token's id and behaviour log-prob concatenated (questions in buffer order, trajectories
        in stored order), each trajectory's length and stamp on the run's clock ("collected_at"), and, when some
        trajectory holds tool or environment tokens, every token's model mask ("model_mask"). Metadata: see
        `state_meta`. (`state_file.save_state` writes the same arrays to disk without concatenating them in memory.)
        """
        trajectories = list(self.iter_trajectories())
        arrays = {
            "completion_ids": _concat([t.completion_ids for t in trajectories], IDS_DTYPE),
            "logps": _concat([t.logps for t in trajectories], LOGPS_DTYPE),
            "lengths": np.array([t.completion_ids.size for t in trajectories], dtype=np.int64),
            "collected_at": np.array([t.collected_at for t in trajectories], dtype=np.int64),
        }
        if any(t.mask is not None for t in trajectories):
            arrays["model_mask"] = _concat([t.model_mask() for t in trajectories], MASK_DTYPE)
        return arrays, self.state_meta()

    @property
    def is_multi_turn(self) -> bool:
        """Whether some stored trajectory holds tool or environment tokens, or a record (state format 2)."""
        return any(t.mask is not None or t.record is not None for t in self.iter_trajectories())

    def load_state_dict(
        self, arrays: dict[str, np.ndarray], meta: dict[str, Any], *, clock: int | None = None, updates_per_batch=None
    ) -> None:
        """Restore what `state_dict` produced. Raises ValueError if the arrays and metadata do not fit together.
        `clock`, `updates_per_batch`: for states written before the clock counted generation batches (`restore`)."""
        self._check_config(meta)
        lengths, steps = arrays["lengths"], arrays["collected_at"]
        ids, logps = arrays["completion_ids"], arrays["logps"]
        counts = [q["num_trajectories"] for q in meta["questions"]]
        if sum(counts) != lengths.size or steps.size != lengths.size:
            raise ValueError(
                f"{sum(counts)} trajectories listed but {lengths.size} lengths / {steps.size} stamps saved"
            )
        if int(lengths.sum()) != ids.size or ids.size != logps.size:
            raise ValueError(
                f"lengths add up to {int(lengths.sum())} tokens, but {ids.size} ids and {logps.size} "
                "log-probs were saved"
            )
        masks = arrays.get("model_mask")  # absent from single-turn states: every token is the model's
        if masks is not None and masks.size != ids.size:
            raise ValueError(f"{ids.size} token ids but {masks.size} model-mask entries were saved")
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        # Copies, not views: a view would keep the whole loaded array alive as long as any one trajectory lives, so
        # the memory of questions retired after a resume would never be reclaimed.
        trajectories = [
            Trajectory(
                ids[offsets[t] : offsets[t + 1]].copy(),
                logps[offsets[t] : offsets[t + 1]].copy(),
                int(steps[t]),
                None if masks is None else masks[offsets[t] : offsets[t + 1]].copy(),
            )
            for t in range(lengths.size)
        ]
        self.restore(meta, trajectories, clock=clock, updates_per_batch=updates_per_batch)

    def restore(
        self,
        meta: dict[str, Any],
        trajectories: Sequence[Trajectory],
        *,
        clock: int | None = None,
        updates_per_batch: float | None = None,
    ) -> None:
        """Replace the buffer's content with `meta` (as `state_meta` returns it) and the trajectories in saved order.
        The buffer takes the trajectories as they are (no copy). Raises ValueError if they do not fit together.

        Restored: questions, buckets, trajectories, the retired set, when questions were replayed, and the generator's
        state (and the seed it came from). Kept: the sampling settings the buffer was built with, i.e. a resumed run's
        config, not the saved one; `config_changes` lists where the two differ.

        A state written before the clock counted generation batches (no "clock") counted replay draws (one per
        generation batch once replay was on) and stamped trajectories with the optimizer step: its draws are moved
        onto `clock` (the generation batches the run had made when it was saved; None: left as they are) and its
        stamps divided by `updates_per_batch` (optimizer updates per generation batch; None: left as they are)."""
        self._check_config(meta)
        counts = [q["num_trajectories"] for q in meta["questions"]]
        if sum(counts) != len(trajectories):
            raise ValueError(f"{sum(counts)} trajectories listed but {len(trajectories)} saved")
        bad = [q["k"] for q in meta["questions"] if q["k"] not in self._buckets]
        if bad:
            raise ValueError(f"saved buckets {sorted(set(bad))} are outside 1..{self.num_generations - 1}")
        self.seed = meta["config"]["seed"]  # the generator continues from the saved state: it comes from that seed
        self.rng.bit_generator.state = meta["rng_state"]
        self.questions.clear()
        for members in self._buckets.values():
            members.clear()
        t = 0
        for q, n in zip(meta["questions"], counts):
            entry = self.questions[q["key"]] = QuestionEntry(
                row=q["row"], k=q["k"], trajectories=list(trajectories[t : t + n])
            )
            for name in ("records", "advantages", "uses"):  # absent: none of its trajectories has one
                values = q.get(name)
                if values is None:
                    continue
                if len(values) != n:
                    raise ValueError(f"question {q['key']} lists {n} trajectories but {len(values)} {name}")
                attribute = {"records": "record", "advantages": "advantage", "uses": "uses"}[name]
                for trajectory, value in zip(entry.trajectories, values):
                    setattr(trajectory, attribute, value)
            t += n
        # bucket members in their saved order (states written before positions were saved: buffer order)
        in_order = sorted(range(len(counts)), key=lambda i: meta["questions"][i].get("bucket_position", i))
        for i in in_order:
            q = meta["questions"][i]
            self._buckets[q["k"]][q["key"]] = None
        self.retired.clear()
        self.retired.update(meta["retired"])
        replayed_at = {key: int(d) for key, d in meta.get("replayed_at", {}).items()}
        if meta.get("clock") == CLOCK:
            recent = [(int(at), list(keys)) for at, keys in meta.get("recent", [])]
        else:  # draws (states before the reuse limit had none), and the last draws' questions (before `reuse`, none)
            draws = int(meta.get("draws", 0))
            shift = 0 if clock is None else clock - draws
            replayed_at = {key: d + shift for key, d in replayed_at.items()}
            old = meta.get("recent_draws", [])
            recent = [(draws - len(old) + i + shift, list(keys)) for i, keys in enumerate(old)]
            if updates_per_batch:
                for trajectory in trajectories:
                    trajectory.collected_at = int(trajectory.collected_at // updates_per_batch)
        self.replayed_at = replayed_at
        self.recent = collections.deque(recent)

    def config_changes(self, saved_config: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """The sampling settings that differ between a saved state's config and this buffer's: option name -> (saved,
        now). A setting a state was saved without had its default then."""
        changes = {}
        for name, (key, default) in sampling_settings().items():
            saved, now = saved_config.get(key, default), getattr(self.settings, name)
            if saved != now:
                changes[name] = (saved, now)
        return changes

    def _check_config(self, meta: dict[str, Any]) -> None:
        saved = meta["config"]["num_generations"]
        if saved != self.num_generations:
            raise ValueError(
                f"the saved buffer was built with num_generations={saved}, this run uses {self.num_generations}"
            )


def _concat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)


def _has_records(entry: QuestionEntry) -> bool:
    return any(t.record is not None for t in entry.trajectories)


def _same_ids(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))
