"""ExGRPO trained with a real vLLM (PyPI's CPU build), replay forced on, in server mode and in colocate mode.

Each mode trains a tiny locally built model for a few steps and records, through spies on the real calls:
- what is sent to vLLM (TRL's `VLLMGeneration.generate`, and below it the HTTP client's `generate` in server mode or
  `vllm.LLM.generate` in colocate mode) and what comes back;
- the plan, the buffer as the plan saw it, and the batch TRL scored;
- after every weight sync, vLLM's log-probs of a fixed sequence (`prompt_logprobs`) and the trained model's.

The model is Llama-shaped, not the Qwen2 of `exgrpo_trl.tasks.toy`: with a Llama config vLLM loads the char tokenizer
saved beside the model as it is, so vLLM stops on our `<eos>` exactly as TRL's tokenizer sees it; with a Qwen2 config
vLLM loads Qwen's byte-level tokenizer class instead. Hidden 128 with 2 heads (head size 64: vLLM's CPU attention
has no kernel for head size 16), float32 on both sides (vLLM would otherwise run a float32 checkpoint in bfloat16,
a log-prob gap of ~4e-3 instead of ~1e-6).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from exgrpo_trl.trainer import BatchKey
from tests.helpers import make_reward, make_trainer, synthetic_dataset

from . import cpu_weight_sync
from .helpers import _free_port, build_model_dir, trl_vllm_serve, vllm_env

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # torch.distributed.reduce_op, seen by vLLM's dispatcher
    pytest.mark.filterwarnings("ignore:OMP_NUM_THREADS/MKL_NUM_THREADS unset:UserWarning"),  # accelerate, use_cpu
]

K = 8  # generations per prompt
GROUPS = 4  # per generation batch
MAX_STEPS = 4  # one generation batch per optimizer step: syncs after steps 0..3
LOGPROB_TOL = 2e-5  # |vLLM - trained model| per token: float32 both sides gives ~5e-7, bfloat16 vLLM 1e-3 to 7e-3
FIXED_TEXT = "12+34=46"  # + <eos>: the sequence whose log-probs are compared after every weight sync


# ---------------------------------------------------------------------------------------------------- model
def _fixed_ids(tokenizer) -> list[int]:
    return tokenizer(FIXED_TEXT)["input_ids"] + [tokenizer.eos_token_id]


@torch.no_grad()
def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 under the trained model, float32."""
    x = torch.tensor([ids], device=model.device)
    logits = model(input_ids=x).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None])[:, 0].cpu()


def _vllm_logprobs(vllm_generation, ids: list[int], llm_generate=None) -> torch.Tensor:
    """The same log-probs computed by vLLM itself (`prompt_logprobs`), through the mode's real interface."""
    if vllm_generation.mode == "server":
        result = vllm_generation.vllm_client.get_sequence_logprobs([ids], [1], top_logprobs=1)
        return torch.tensor([lp[0] for lp in result["actual_logprobs"][0]], dtype=torch.float32)
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    (output,) = llm_generate([{"prompt_token_ids": ids}], sampling_params=params, use_tqdm=False)
    return torch.tensor([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], ids[1:])])


def instrument(trainer, fixed_ids: list[int]) -> None:
    """Spy on the real vLLM calls of this trainer; nothing is replaced (the weight-sync glue is installed apart)."""
    vg = trainer.vllm_generation
    batches = trainer.batches

    trl_generate = vg.generate

    def generate(prompts, images, num_generations, profiler=None):
        result = trl_generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)
        if batches and "vllm" not in batches[-1]:
            _, completion_ids, logprobs, _ = result
            batches[-1]["vllm"] = {
                "prompts": [list(p) for p in prompts],
                "num_generations": num_generations,
                "completion_ids": [list(c) for c in completion_ids],
                "logprobs": [[lp[0] for lp in seq] for seq in logprobs],
            }
        return result

    vg.generate = generate

    if vg.mode == "server":
        client = vg.vllm_client
        client_generate = client.generate

        def spy_client_generate(prompts, *args, **kwargs):
            batches[-1]["engine_calls"].append({"prompts": [list(p) for p in prompts], "n": kwargs.get("n")})
            return client_generate(prompts, *args, **kwargs)

        client.generate = spy_client_generate
        probe_generate = None
    else:
        llm = vg.llm
        probe_generate = llm.generate  # the probe below bypasses the spy

        def spy_llm_generate(prompts, sampling_params=None, **kwargs):
            batches[-1]["engine_calls"].append(
                {"prompts": [list(p["prompt_token_ids"]) for p in prompts], "n": sampling_params.n}
            )
            return probe_generate(prompts, sampling_params=sampling_params, **kwargs)

        llm.generate = spy_llm_generate

    sync_weights = vg.sync_weights

    def probed_sync_weights():
        sync_weights()
        hf = _hf_logprobs(trainer.model, fixed_ids)
        got = _vllm_logprobs(vg, fixed_ids, probe_generate)
        batches[-1]["syncs"].append({"step": trainer.state.global_step, "hf": hf, "vllm": got})

    vg.sync_weights = probed_sync_weights


# ---------------------------------------------------------------------------------------------------- environment
def _float32_llm(monkeypatch) -> None:
    """TRL's colocate mode passes no dtype: make its `vllm.LLM(...)` float32 (and eager, to start faster)."""
    from trl.generation import vllm_generation

    real_llm = vllm_generation.LLM

    def llm(*args, **kwargs):
        return real_llm(*args, **{**kwargs, "dtype": "float32", "enforce_eager": True})

    monkeypatch.setattr(vllm_generation, "LLM", llm)


# ---------------------------------------------------------------------------------------------------- the runs
def run_exgrpo(mode: str, work: Path, rollout: bool = False) -> dict:
    """One run in `mode`; `rollout`: generation through a user's rollout function that calls the trainer's vLLM
    (tests/support/rollouts.py), without offline guidance (which takes no rollout function)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from tests.support.rollouts import FieldLog, make_vllm_rollout

    model_dir = build_model_dir(work / "model")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    env = vllm_env(work)
    timings = {}
    with pytest.MonkeyPatch.context() as mp, contextlib.ExitStack() as stack:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.setattr(tempfile, "tempdir", env["TMPDIR"])
        extra = {}
        if mode == "server":
            started = time.monotonic()
            extra["vllm_server_base_url"] = stack.enter_context(trl_vllm_serve(model_dir, work, env))
            timings["server_start_s"] = time.monotonic() - started
            cpu_weight_sync.install_server_sync(mp, str(work / "weights"))
        else:
            # TRL sets these for vLLM's external launcher; registering them here restores them afterwards.
            for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(_free_port())}.items():  # fmt: skip
                mp.setenv(key, value)
            _float32_llm(mp)
            cpu_weight_sync.install_colocate_sync(mp)

        started = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        from tests.support.recording import RecordingTrainer

        log = FieldLog()
        rollout_kwargs = {"trainer_kwargs": {"rollout_func": make_vllm_rollout(log)}} if rollout else {}
        if rollout:
            mp.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
        trainer = make_trainer(
            work,
            tokenizer,
            cls=RecordingTrainer,
            model=model,
            train_dataset=synthetic_dataset() if rollout else offline_dataset(),
            use_vllm=True,
            vllm_mode=mode,
            vllm_max_model_length=64,
            per_device_train_batch_size=K * GROUPS,
            num_generations=K,
            max_completion_length=8,
            learning_rate=3e-4,  # every sync really moves the weights, not so fast that all questions retire
            max_steps=MAX_STEPS,
            replay_start_pass_rate=0.0,  # replay forced on from the first batch the buffer can serve
            replay_ratio=0.5,
            reward_funcs=log.reward(make_reward(tokenizer)),
            **({} if rollout else {"offline_solutions_column": "solution"}),  # every third question (algorithm §11)
            **rollout_kwargs,
            **extra,
        )
        timings["trainer_init_s"] = time.monotonic() - started
        fixed = _fixed_ids(tokenizer)
        initial = _hf_logprobs(trainer.model, fixed)
        instrument(trainer, fixed)
        started = time.monotonic()
        trainer.train()
        timings["train_s"] = time.monotonic() - started

        record = {
            "mode": mode,
            "tokenizer": tokenizer,
            "batches": trainer.batches,
            "initial_logprobs": initial,
            "buffer": {
                "questions": trainer.exgrpo_state.buffer.num_questions,
                "trajectories": trainer.exgrpo_state.buffer.num_trajectories,
                "retired": len(trainer.exgrpo_state.buffer.retired),
            },
            "log_history": trainer.state.log_history,
            "timings": timings,
            "rewards_saw": log,
        }
        if mode == "colocate":
            vg = trainer.vllm_generation
            del vg.llm  # release the engine (its memory) before the next module's tests
        del trainer, model
    with contextlib.suppress(OSError):
        shutil.rmtree(work / "tmp")
    return record


@pytest.fixture(scope="module", params=["server", "colocate"])  # server first: colocate leaves a process group behind
def vllm_run(request, tmp_path_factory, vllm_report):
    record = run_exgrpo(request.param, tmp_path_factory.mktemp(f"vllm-{request.param}"))
    record["report"] = vllm_report
    vllm_report.append(f"{record['mode']}: " + ", ".join(f"{k} {v:.1f}" for k, v in record["timings"].items()))
    return record


@pytest.fixture(scope="module", params=["server", "colocate"])
def vllm_rollout_run(request, tmp_path_factory, vllm_report):
    """The same run with a rollout function that generates through the trainer's vLLM."""
    record = run_exgrpo(request.param, tmp_path_factory.mktemp(f"vllm-rollout-{request.param}"), rollout=True)
    record["report"] = vllm_report
    vllm_report.append(
        f"{record['mode']} rollout_func: " + ", ".join(f"{k} {v:.1f}" for k, v in record["timings"].items())
    )
    return record


OFFLINE_SOLUTION = "12"  # 3 tokens with EOS: solved by the synthetic reward


def offline_dataset():
    """The synthetic questions, every third one with an offline solution."""
    dataset = synthetic_dataset()
    return dataset.add_column("solution", [[OFFLINE_SOLUTION] if i % 3 == 0 else [] for i in range(len(dataset))])


def _tok(record, text: str) -> list[int]:
    return record["tokenizer"](text)["input_ids"]


def sent_position(batch, mode: str) -> dict[int, int]:
    """Batch row -> its index in what reached vLLM. Server mode generates every row (K per distinct prompt);
    colocate mode (no tensor parallelism) leaves out the rows a stored trajectory takes."""
    rows = [r for r in range(K * GROUPS) if mode == "server" or r not in batch["splice"]]
    return {row: i for i, row in enumerate(rows)}


# ---------------------------------------------------------------------------------------------------- tests
def test_group_prompts_identical_and_contiguous(vllm_run):
    """Every group's K prompt rows are identical and contiguous in what reaches vLLM, replayed groups included
    (in colocate mode a replayed group sends its K-1 fresh rows)."""
    assert len(vllm_run["batches"]) == MAX_STEPS
    for batch in vllm_run["batches"]:
        rows = batch["vllm"]["prompts"]
        position = sent_position(batch, vllm_run["mode"])
        assert len(rows) == len(position) and batch["vllm"]["num_generations"] == K
        for g in range(GROUPS):
            group = [rows[position[r]] for r in range(g * K, (g + 1) * K) if r in position]
            assert len(group) == K - (g * K in batch["splice"] and vllm_run["mode"] == "colocate")
            assert all(r == group[0] for r in group), (g, group)
            assert group[0] == _tok(vllm_run, batch["prompts"][g * K])
        plan = batch["plan"]
        for j, g in enumerate(plan.group_indices if plan else []):
            assert rows[position[g * K + 1]] == _tok(vllm_run, plan.rows[j]["prompt"])  # the stored question's own
        # what the engine itself received: one request per generation batch
        (call,) = batch["engine_calls"]
        if vllm_run["mode"] == "server":
            # TRL de-duplicates as rows[::K] and asks for n=K: only right because groups are identical and contiguous
            assert call["n"] == K and call["prompts"] == rows[::K]
        else:
            assert call["n"] == 1 and call["prompts"] == rows


def test_stored_trajectories_spliced_into_the_right_rows(vllm_run):
    replayed = offline_rows = 0
    for batch in vllm_run["batches"]:
        plan, out, sent = batch["plan"], batch["output"], batch["vllm"]
        position = sent_position(batch, vllm_run["mode"])
        n_exp = min(
            batch["before"]["questions"], GROUPS // 2
        )  # rho = 0.5: floor(0.5 * 4 groups), at most the buffer's size
        assert (len(plan.group_indices) if plan else 0) == n_exp
        mask = out.get(BatchKey.REPLAY_MASK, torch.zeros(K * GROUPS, dtype=torch.bool))
        replay_rows = {g * K: j for j, g in enumerate(plan.group_indices)} if plan else {}
        offline = batch["offline"]  # fresh groups' first rows given their question's offline solution
        assert sorted(batch["splice"]) == sorted(set(replay_rows) | set(offline)) and not set(replay_rows) & set(
            offline
        )
        assert [bool(m) for m in mask] == [r in replay_rows or r in offline for r in range(K * GROUPS)]
        solution = _tok(vllm_run, OFFLINE_SOLUTION) + [vllm_run["tokenizer"].eos_token_id]
        for row in range(K * GROUPS):
            length = int(out["completion_mask"][row].sum())
            ids = out["completion_ids"][row, :length].tolist()
            if row in offline:
                assert ids == solution and row % K == 0 and bool(out[BatchKey.OFFLINE][row])
                offline_rows += 1
            elif row in replay_rows:
                j = replay_rows[row]
                key = plan.keys[j]
                assert ids == plan.completion_ids[j]  # the selected stored trajectory, token for token
                assert ids in batch["before"]["trajectories"][key]  # ... stored for that very question
                assert batch["prompts"][row] == plan.rows[j]["prompt"]
                replayed += 1
            else:
                assert ids == sent["completion_ids"][position[row]]  # fresh rows keep what vLLM generated
    assert vllm_run["batches"][0]["plan"] is None  # the buffer starts empty
    assert replayed >= 2 and offline_rows >= 2, (replayed, offline_rows)
    vllm_run["report"].append(
        f"{vllm_run['mode']}: {replayed} stored trajectories and {offline_rows} offline solutions spliced over "
        f"{MAX_STEPS} batches"
    )


def test_importance_ratio_one_for_spliced_rows_and_vllm_logprobs_for_fresh(vllm_run):
    deltas, spliced, corrected = [], 0, 0
    for batch in vllm_run["batches"]:
        out, sent = batch["output"], batch["vllm"]
        position = sent_position(batch, vllm_run["mode"])
        ratio = out["importance_sampling_ratio"]  # (B, 1): TRL's default "sequence_mask" mode
        sampling, old = out["sampling_per_token_logps"], out["old_per_token_logps"]
        assert ratio.shape == (K * GROUPS, 1)
        for row in range(K * GROUPS):
            length = int(out["completion_mask"][row].sum())
            if row in batch["splice"]:
                assert torch.isnan(sampling[row, :length]).all()  # [None] * len(ids) reached TRL as NaN
                assert ratio[row, 0].item() == 1.0  # exactly: the correction leaves the stored trajectory alone
                spliced += 1
            else:
                expected = torch.tensor(sent["logprobs"][position[row]], dtype=torch.float32)
                assert torch.equal(sampling[row, :length], expected)  # vLLM's own sampling log-probs, unchanged
                diff = (old[row, :length] - sampling[row, :length]).double()
                deltas.append(diff.abs().max().item())
                recomputed = math.exp(diff.sum().item())
                recomputed = 0.0 if recomputed > 3.0 else recomputed  # TRL's clip_max for sequence_mask
                assert ratio[row, 0].item() == pytest.approx(recomputed, rel=1e-5)
                corrected += ratio[row, 0].item() != 1.0
    # vLLM sampled from the weights just synced: its log-probs are the trainer's, up to float32 kernel noise
    vllm_run["report"].append(
        f"{vllm_run['mode']}: IS ratio exactly 1 on {spliced} spliced rows; {len(deltas)} fresh rows keep vLLM's "
        f"log-probs ({corrected} with a ratio != 1), max |TRL old logp - vLLM sampling logp| = {max(deltas):.1e}"
    )
    assert spliced >= 2 and max(deltas) < LOGPROB_TOL


def test_vllm_logprobs_match_trained_model_after_each_weight_sync(vllm_run):
    syncs = [s for batch in vllm_run["batches"] for s in batch["syncs"]]
    assert [s["step"] for s in syncs] == list(range(MAX_STEPS))  # one sync per optimizer step
    gaps = [(s["vllm"] - s["hf"]).abs().max().item() for s in syncs]
    moved = [(s["hf"] - vllm_run["initial_logprobs"]).abs().max().item() for s in syncs]
    vllm_run["report"].append(
        f"{vllm_run['mode']}: after each weight sync, max |vLLM - trained model| log-prob of a fixed sequence = "
        f"{', '.join(f'{g:.1e}' for g in gaps)} (the trained model moved from init by "
        f"{', '.join(f'{m:.1e}' for m in moved)})"
    )
    assert all(g < LOGPROB_TOL for g in gaps), gaps
    assert moved[0] == 0.0 and moved[-1] > 100 * LOGPROB_TOL, moved  # the syncs carried real updates


def test_buffer_fills(vllm_run):
    sizes = [b["buffer_after"] for b in vllm_run["batches"]]
    assert sizes[0] == 0 and all(size > 0 for size in sizes[1:]), sizes  # collected from the first batch on
    assert vllm_run["buffer"]["questions"] > 0
    history = [h for h in vllm_run["log_history"] if "loss" in h]
    assert history[-1]["exgrpo/replay/fraction"] == 0.5
    assert all(math.isfinite(h["loss"]) for h in history)
    vllm_run["report"].append(
        f"{vllm_run['mode']}: buffer after each batch's scoring {sizes}; at the end "
        + ", ".join(f"{k} {v}" for k, v in vllm_run["buffer"].items())
    )


def test_rollout_func_generating_with_vllm_replays(vllm_rollout_run):
    """A user's rollout function that calls the trainer's vLLM (colocate and server mode): TRL syncs the weights
    before each call, the function generates every row (K per question), and the stored trajectory replaces its
    row, with the per-row field the function returned for it when it was collected."""
    run, log = vllm_rollout_run, vllm_rollout_run["rewards_saw"]
    assert log.calls == len(run["batches"]) == MAX_STEPS
    replayed = 0
    for b, batch in enumerate(run["batches"]):
        plan, out, sent = batch["plan"], batch["output"], batch["vllm"]
        assert (len(plan.group_indices) if plan else 0) == min(batch["before"]["questions"], GROUPS // 2)
        assert sent["num_generations"] == K and len(sent["prompts"]) == K * GROUPS  # every row generated
        for j, group in enumerate(plan.group_indices if plan else []):
            row, ids = group * K, plan.completion_ids[j]
            assert out["completion_ids"][row, : len(ids)].tolist() == ids == log.ids[b][row]
            assert ids in batch["before"]["trajectories"][plan.keys[j]]
            draw = plan.record(j)["fields"]["draw"]
            call, source = map(int, draw.split(":"))
            assert log.draws[b][row] == draw and call < b and log.ids[call][source] == ids
            replayed += 1
    assert replayed >= 4, replayed
    syncs = [s for batch in run["batches"] for s in batch["syncs"]]
    assert [s["step"] for s in syncs] == list(range(MAX_STEPS))  # TRL synced before each call of the function
    assert all((s["vllm"] - s["hf"]).abs().max().item() < LOGPROB_TOL for s in syncs)  # with the trained weights
    run["report"].append(
        f"{run['mode']} rollout_func: {replayed} stored trajectories spliced over {MAX_STEPS} batches"
    )
