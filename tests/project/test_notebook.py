"""notebooks/exgrpo_lora_single_gpu.ipynb: executed end to end in its CPU mode with nbclient (tiny local model, toy
task, LoRA, 20 ExGRPO steps, the plots, the before/after table, the model card, and the Hub push through the local
stand-in of tests/support/hub_stand_in.py); its GPU settings built for real; and the notebook's own rules (no logic of
its own, committed with the outputs of one CPU run and an install line that works). Plus the package helpers it calls
(exgrpo_trl.utils.plotting, exgrpo_trl.eval.completions)."""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
from huggingface_hub import ModelCard

from tests.helpers import MACHINE_DIRS
from tests.support import hub_stand_in

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "exgrpo_lora_single_gpu.ipynb"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BUFFER_PRINTED = re.compile(r"buffer at the end: (\d+) questions, (\d+) trajectories, (\d+) retired")
SUMMARY = re.compile(r"solved before (\d\.\d\d), after (\d\.\d\d); completions that changed: (\d+) of (\d+)")
BUFFER_CARD = re.compile(
    r"Experience buffer at the end of training: (\d+) questions, (\d+) trajectories, (\d+) retired"
)


def _cell(nb, tag: str):
    (cell,) = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    return cell


def _text(cell) -> str:
    """Everything a cell printed (streams) and returned as plain text."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out and "text/plain" in out.data:
            parts.append(out.data["text/plain"])
    return "".join(parts)


def _this_python_kernel(work: Path):
    """A kernel manager that starts this interpreter's ipykernel, whatever `python3` kernelspec the machine has."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    spec = work / "kernels" / "exgrpo-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "exgrpo test", "language": "python"}))
    specs = KernelSpecManager(kernel_dirs=[str(spec.parent)])
    return KernelManager(kernel_name="exgrpo-test", kernel_spec_manager=specs)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    from nbclient import NotebookClient

    work = tmp_path_factory.mktemp("notebook")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The only change to the notebook: a first cell that puts the Hub stand-in in place inside the kernel.
    stand_in = nbformat.v4.new_code_cell(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests.support import hub_stand_in\n"
        f"hub_stand_in.install({str(work / 'hub')!r})"
    )
    nb.cells.insert(0, stand_in)
    env = {
        **os.environ,
        "EXGRPO_NOTEBOOK_CPU": "1",  # the CPU mode even where a GPU is present
        "PUSH_TO_HUB": "1",  # exercise the push cell (through the stand-in)
        "HF_HUB_OFFLINE": "1",  # any other Hub request fails instead of reaching for the network
        "TOKENIZERS_PARALLELISM": "false",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }
    env.pop("HUB_REPO", None)
    env.pop("MERGE_ADAPTER", None)
    client = NotebookClient(nb, km=_this_python_kernel(work), timeout=600, resources={"metadata": {"path": str(work)}})
    client.execute(env=env)
    return nb, work


def test_notebook_runs_end_to_end_on_cpu(executed):
    nb, work = executed
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code_cells)
    assert "mode: CPU fallback" in _text(_cell(nb, "setup"))
    assert "trainable params" in _text(_cell(nb, "trainer"))


def test_notebook_plots_reward_and_buffer(executed):
    nb, _ = executed
    cell = _cell(nb, "plot")
    images = [out.data["image/png"] for out in cell.outputs if "data" in out and "image/png" in out.data]
    assert len(images) == 1  # the 2x2 figure, once
    png = base64.b64decode(images[0])
    assert png[:8] == PNG_SIGNATURE
    import matplotlib.image

    height, width = matplotlib.image.imread(io.BytesIO(png)).shape[:2]
    assert width > 600 and height > 400
    (match,) = BUFFER_PRINTED.findall(_text(cell))
    questions, trajectories, _ = map(int, match)
    # replay from the first step on a warm-started model: the buffer fills within 20 steps
    assert questions > 0 and trajectories >= questions


def test_notebook_compares_completions(executed):
    nb, _ = executed
    cell = _cell(nb, "compare")
    (result,) = [out for out in cell.outputs if out.output_type == "execute_result"]
    html = result.data["text/html"]
    for column in ("question", "answer", "before", "reward before", "after", "reward after"):
        assert f"<th>{column}</th>" in html
    body = html[html.index("<tbody>") : html.index("</tbody>")]
    assert body.count("<tr>") == 16
    assert len(re.findall(r"<td>\d+\+\d+=</td>", body)) == 16  # the 16 held-out additions
    # the summary line: solved shares before and after, and how many completions the 20 updates changed (it showed
    # 0/4 solved before and after, nothing that moved); the shares are k / 16
    (summary,) = SUMMARY.findall(_text(cell))
    before, after, changed, shown = float(summary[0]), float(summary[1]), int(summary[2]), int(summary[3])
    rows = [re.findall(r"<td>(.*?)</td>", row) for row in body.split("<tr>")[1:]]
    # columns: question, answer, before, reward before, after, reward after; the line agrees with the table
    assert shown == 16 and changed == sum(r[2] != r[4] for r in rows) and changed > 0
    assert (before, after) == (
        round(sum(float(r[3]) for r in rows) / 16, 2),
        round(sum(float(r[5]) for r in rows) / 16, 2),
    )


def test_notebook_card_and_push(executed):
    nb, work = executed
    out_dir = work / "outputs" / "tiny-exgrpo-lora"
    card = (out_dir / "README.md").read_text()
    assert any("text/markdown" in out.get("data", {}) for out in _cell(nb, "card").outputs)
    assert card.count("## ExGRPO training") == 1 and "zhan2025exgrpo" in card
    # the card's buffer numbers are the ones the notebook printed after training
    assert BUFFER_CARD.findall(card) == BUFFER_PRINTED.findall(_text(_cell(nb, "plot")))

    (upload,) = hub_stand_in.read_uploads(work / "hub")
    assert upload["repo_id"] == "tester/tiny-exgrpo-lora"  # no HUB_REPO: the output folder's name
    files = set(upload["files"])
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= files
    assert "model.safetensors" not in files and "config.json" not in files
    pushed_card = (upload["dir"] / "README.md").read_text()
    assert BUFFER_CARD.findall(pushed_card) == BUFFER_CARD.findall(card)
    assert {"trl", "grpo", "exgrpo", "lora", "math"} <= set(ModelCard(pushed_card).data.tags)
    url = "https://huggingface.co/tester/tiny-exgrpo-lora/commit/"
    assert f"pushed the LoRA adapter to tester/tiny-exgrpo-lora: {url}" in _text(_cell(nb, "push"))


# ---------------------------------------------------------------------------------------------------------------
# The notebook as committed
# ---------------------------------------------------------------------------------------------------------------
def test_notebook_is_committed_with_one_cpu_runs_outputs():
    """A reader sees what they get: every code cell holds its outputs from one run in the CPU mode, in order, with no
    error and no path of the machine it ran on; the buffer the run printed is not empty."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code_cells] == list(range(1, len(code_cells) + 1))
    assert "mode: CPU fallback" in _text(_cell(nb, "setup"))
    assert all(out.output_type != "error" for c in code_cells for out in c.outputs)
    assert all(c.outputs for c in code_cells if "tags" in c.metadata and c.metadata["tags"][0] != "gpu-settings")
    raw = NOTEBOOK.read_text()
    for path in (f"/{name}/" for name in MACHINE_DIRS):
        assert path not in raw, path
    (match,) = BUFFER_PRINTED.findall(_text(_cell(nb, "plot")))
    assert int(match[0]) > 0


def test_notebook_install_line_and_gpu_estimate():
    """The install line names what a clone installs (the notebook extra exists); `pip install "exgrpo-trl[...]"`
    named a package index that does not have the package. The GPU cost is given, and marked as an estimate."""
    import tomllib

    nb = nbformat.read(NOTEBOOK, as_version=4)
    intro = nb.cells[0].source
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    lines = re.findall(r'`pip install "\.\[([a-z,]+)\]"`', intro)
    assert lines and all(set(line.split(",")) <= extras for line in lines), lines
    assert "exgrpo-trl[" not in intro
    settings = nb.cells[nb.cells.index(_cell(nb, "gpu-settings")) - 1].source
    assert re.search(r"an estimate.*not measured", settings) and "GB" in settings and "hours" in settings


def test_notebook_holds_no_logic():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    forbidden = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.For, ast.While,
                 ast.ListComp, ast.DictComp, ast.SetComp, ast.GeneratorExp)  # fmt: skip
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        nodes = [type(n).__name__ for n in ast.walk(ast.parse(cell.source)) if isinstance(n, forbidden)]
        assert not nodes, f"logic belongs in the package, not the notebook: {nodes} in\n{cell.source}"
    # exactly one cell switches to the CPU fallback, and it is marked as such
    cpu_cells = [c for c in nb.cells if c.cell_type == "code" and "if not GPU:" in c.source]
    assert len(cpu_cells) == 1 and "cpu-fallback" in cpu_cells[0].metadata["tags"]
    index = nb.cells.index(cpu_cells[0])
    assert nb.cells[index - 1].cell_type == "markdown" and "CPU fallback" in nb.cells[index - 1].source


def test_notebook_gpu_settings_are_valid(monkeypatch, tmp_path):
    """The GPU cell's `LoraConfig(...)` and `ExGRPOConfig(...)` calls, evaluated as written (bf16 allowed as on a
    GPU, vLLM reported present): field names, values and the batch arithmetic are checked by the configs
    themselves. Training on the GPU itself does not run here."""
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    from peft import LoraConfig

    from exgrpo_trl import ExGRPOConfig

    cell = _cell(nbformat.read(NOTEBOOK, as_version=4), "gpu-settings")
    calls = {}
    for node in ast.walk(ast.parse(cell.source)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
            calls[node.targets[0].id] = node.value
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            calls[node.targets[0].id] = node.value
    namespace = {"ExGRPOConfig": ExGRPOConfig, "LoraConfig": LoraConfig, "vllm_available": lambda: True,
                 "OUTPUT_DIR": str(tmp_path / "out")}  # fmt: skip
    evaluate = lambda name: eval(compile(ast.Expression(calls[name]), "<gpu cell>", "eval"), namespace)  # noqa: E731
    assert evaluate("MODEL") == "Qwen/Qwen2.5-Math-1.5B"
    lora = evaluate("peft_config")
    assert lora.r == 64 and lora.target_modules == "all-linear"
    args = evaluate("args")
    assert args.bf16 and args.use_vllm and args.vllm_mode == "colocate" and args.gradient_checkpointing
    # 32 questions x 8 rollouts per generation batch, 2 optimizer steps of 128 rows each
    assert args.generation_batch_size == 256 and args.num_generations == 8
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 128
    assert args.steps_per_generation == 32  # micro-batches per generation batch: 2 optimizer steps x 16
    assert (args.replay_ratio, args.replay_start_pass_rate, args.policy_shaping_gamma) == (0.5, 0.35, 0.1)


# ---------------------------------------------------------------------------------------------------------------
# The helpers the notebook calls
# ---------------------------------------------------------------------------------------------------------------
def test_plot_training_draws_each_series(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from exgrpo_trl.buffer import ExperienceBuffer
    from exgrpo_trl.utils.plotting import plot_training

    history = [
        {"step": s, "reward": r, "exgrpo/batch/pass_at_1": r, "exgrpo/buffer/questions": q,
         "exgrpo/buffer/trajectories": 2 * q, "exgrpo/buffer/retired": s - 1, "exgrpo/replay/fraction": f,
         "exgrpo/replay/active": 1.0, "exgrpo/buffer/bucket_1": q, "exgrpo/buffer/bucket_2": 0}
        for s, r, q, f in [(1, 0.1, 0, 0.0), (2, 0.3, 2, 0.25), (3, 0.5, 3, 0.5)]
    ] + [{"train_runtime": 1.0, "step": 3}]  # fmt: skip
    fig = plot_training(history, smoothing=2)
    (reward, buffer_ax, replay, buckets) = fig.axes[:4]
    raw, smooth, pass_at_1 = reward.lines
    assert list(raw.get_xdata()) == [1, 2, 3] and list(raw.get_ydata()) == [0.1, 0.3, 0.5]
    assert list(smooth.get_ydata()) == pytest.approx([0.1, 0.2, 0.4])  # window 2
    assert [list(line.get_ydata()) for line in buffer_ax.lines] == [[0, 2, 3], [0, 1, 2]]  # questions, retired
    assert list(fig.axes[4].lines[0].get_ydata()) == [0, 4, 6]  # trajectories, on the right axis
    assert list(replay.lines[0].get_ydata()) == [0.0, 0.25, 0.5]
    assert [p.get_height() for p in buckets.patches] == [3, 0]  # from the last logged bucket counts
    plt.close(fig)

    live = ExperienceBuffer(4)
    live.retired.add("x")
    fig = plot_training(history, live)  # the buffer, when given, is the histogram's source
    assert [p.get_height() for p in fig.axes[3].patches] == [0, 0, 0]
    plt.close(fig)


def test_sample_and_compare_completions(tokenizer):
    from exgrpo_trl.eval.completions import compare_completions, question_text, sample_completions
    from exgrpo_trl.tasks.toy import addition_reward
    from tests.helpers import make_model

    model = make_model(tokenizer)
    model.train()
    model.generation_config.use_cache = False  # as TRL leaves a policy trained with gradient checkpointing
    prompts = ["12+34=", "5+6=", "7+8="]
    greedy = sample_completions(model, tokenizer, prompts, max_new_tokens=4)
    assert greedy == sample_completions(model, tokenizer, prompts, max_new_tokens=4, batch_size=1)  # deterministic
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) <= 4 for t in greedy)
    assert model.training and model.generation_config.use_cache is False  # left as they were

    # the same as generating by hand, greedily, one prompt at a time
    import torch

    for prompt, text in zip(prompts, greedy):
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.eval().generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        assert text == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    table = compare_completions(prompts, ["46", "11", "15"], ["46", "12", "x"], ["46", "11", "15"], addition_reward)
    assert list(table.columns) == ["question", "answer", "before", "reward before", "after", "reward after"]
    assert table["reward before"].tolist() == [1.0, 0.0, 0.0] and table["reward after"].tolist() == [1.0, 1.0, 1.0]
    assert question_text([{"role": "system", "content": "s"}, {"role": "user", "content": "q?"}]) == "q?"
    long = compare_completions(["1+1="], ["2"], ["a" * 500 + "2"], ["2"], addition_reward, max_chars=10)
    assert long["before"][0] == "…" + "a" * 8 + "2"
    with pytest.raises(ValueError, match="same length"):
        compare_completions(prompts, ["1"], greedy, greedy, addition_reward)
