"""Image inputs under replay, on a tiny Qwen2-VL built offline (exgrpo_trl/tasks/vision.py): question keys that hold
the images, images in the saved state, entropy scoring with the question's images, replay_ratio=0 against
GRPOTrainer, replayed rows carrying their question's image, and a resume with images in the buffer."""

from __future__ import annotations

import contextlib
import hashlib
import io

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from exgrpo_trl.buffer import ExperienceBuffer, Trajectory, image_digest, question_key, row_key
from exgrpo_trl.checks import IMAGE_MULTI_TURN, IMAGE_VLLM
from exgrpo_trl.tasks.vision import build_tiny_vlm, colour_dataset, colour_image, colour_reward, vlm_prompt
from tests.helpers import make_trainer

K = 4


def vlm_trainer(tmp_path, cls=None, dataset=None, seed=0, **config):
    model, processor = build_tiny_vlm(seed=seed)
    settings = dict(per_device_train_batch_size=16, num_generations=K, max_completion_length=4, max_steps=4)
    return make_trainer(
        tmp_path,
        processor,
        cls=cls,
        model=model,
        reward_funcs=colour_reward,
        train_dataset=colour_dataset(32, seed=1) if dataset is None else dataset,
        **{**settings, **config},
    )


def test_a_question_key_holds_its_images():
    prompt = vlm_prompt()
    red, blue = colour_image("red"), colour_image("blue")
    # the same text over two images: two questions; the same pixels in another object: the same question
    assert question_key(prompt, [red]) != question_key(prompt, [blue])
    assert question_key(prompt, [red]) == question_key(prompt, [colour_image("red")])
    assert row_key({"prompt": prompt, "image": red}) == question_key(prompt, [red])
    assert row_key({"prompt": prompt, "images": [red, blue]}) != row_key({"prompt": prompt, "images": [blue, red]})
    # without images the key is the prompt's alone (as saved states hold it): blake2b-128 of the text
    assert question_key("1+1=") == hashlib.blake2b(b"1+1=", digest_size=16).hexdigest()
    assert row_key({"prompt": "1+1=", "image": None}) == question_key("1+1=")
    # an image's digest is its pixels': mode "RGB", 28 x 28, then 28 * 28 * 3 bytes of (255, 0, 0)
    expected = hashlib.blake2b(b"RGB:28x28:" + bytes([255, 0, 0]) * 28 * 28, digest_size=16).hexdigest()
    assert image_digest(red) == expected


def test_images_are_saved_in_the_state_as_png_bytes(tmp_path):
    # imported here: scripts/same_behaviour.py builds this file's trainer against older package versions too
    from exgrpo_trl.state_file import ARRAYS_FILENAME, META_FILENAME, STATE_DIRNAME, load_state, read_meta, save_state

    buffer = ExperienceBuffer(K)
    red, blue = colour_image("red"), colour_image("blue", size=56)
    for image in (red, blue):
        row = {"prompt": vlm_prompt(), "image": image, "answer": "x"}
        buffer.update_group(row_key(row), 2, row, [Trajectory(np.array([5, 1]), np.array([-0.5, -0.25]), 3)])
    save_state(tmp_path, buffer, {"replay_active": True})
    meta = read_meta(tmp_path)
    assert meta["format_version"] == 3
    # the rows in state.json hold references where the images were
    assert [q["row"]["image"] for q in meta["buffer"]["questions"]] == [{"exgrpo_image": 0}, {"exgrpo_image": 1}]
    png = []
    for image in (red, blue):
        out = io.BytesIO()
        image.save(out, format="PNG")
        png.append(out.getvalue())
    # the bytes stored per question: its image's PNG encoding, no more
    assert meta["arrays"]["image_lengths"]["size"] == 2
    assert meta["arrays"]["image_bytes"]["size"] == len(png[0]) + len(png[1])
    raw = (tmp_path / STATE_DIRNAME / ARRAYS_FILENAME).read_bytes()
    assert png[0] + png[1] in raw
    assert "exgrpo_image" in (tmp_path / STATE_DIRNAME / META_FILENAME).read_text()

    restored = ExperienceBuffer(K)
    load_state(tmp_path, restored)
    assert list(restored.questions) == list(buffer.questions)  # the keys: the pixels came back exactly
    for key, entry in restored.questions.items():
        assert (
            row_key(entry.row) == key and entry.row["image"].tobytes() == buffer.questions[key].row["image"].tobytes()
        )
    # the buffer's own rows were not touched by saving
    assert all(not isinstance(e.row["image"], dict) for e in buffer.questions.values())


def test_init_rejects_what_is_not_replayed_with_images(tmp_path):
    with pytest.raises(NotImplementedError) as info:
        vlm_trainer(tmp_path, trainer_kwargs={"tools": [len]})
    assert str(info.value) == IMAGE_MULTI_TURN
    with pytest.raises(NotImplementedError) as info:
        vlm_trainer(tmp_path, use_vllm=True)
    assert str(info.value) == IMAGE_VLLM


def test_entropy_scoring_uses_the_question_image(tmp_path):
    """The scorer's mean entropy of a stored completion equals one computed here by hand from the processor and the
    model (prompt with its image, then the completion, entropy of each completion token's next-token distribution),
    and another image gives another figure."""
    trainer = vlm_trainer(tmp_path)
    processor, model = trainer.processing_class, trainer.model.eval()
    completion = processor.tokenizer.convert_tokens_to_ids(["red", "blue", "<|im_end|>"])

    def by_hand(image):
        messages = [{"role": "user", "content": [{"type": "image", "image": image}, vlm_prompt()[0]["content"][1]]}]
        encoded = processor.apply_chat_template(
            [messages], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        ids = torch.cat([encoded["input_ids"], torch.tensor([completion])], dim=1)
        extra = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        types = torch.cat([encoded["mm_token_type_ids"], torch.zeros(1, len(completion), dtype=torch.long)], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=types, **extra).logits[0, -len(completion) - 1 : -1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return float(-(logp.exp() * logp).sum(-1).mean())

    rows = [{"prompt": vlm_prompt(), "image": colour_image(c), "answer": c} for c in ("red", "green")]
    scores = trainer._exgrpo_score_candidates(rows, [r["prompt"] for r in rows], [completion] * 2, [None, None])
    expected = [by_hand(colour_image("red")), by_hand(colour_image("green"))]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert abs(expected[0] - expected[1]) > 1e-4  # the image matters, so the comparison means something


def test_scoring_processes_each_question_once_for_its_prompt_tokens(tmp_path):
    """Candidates of one question share its row and prompt: the first tokenization (the prompt tokens that order the
    chunks) runs the processor once per question, not per candidate, and every candidate scores as it does alone."""
    trainer = vlm_trainer(tmp_path)
    trainer.model.eval()
    ids = trainer.processing_class.tokenizer.convert_tokens_to_ids
    completions = [ids(["red", "<|im_end|>"]), ids(["blue", "blue", "<|im_end|>"]), ids(["green", "<|im_end|>"])]
    red = {"prompt": vlm_prompt(), "image": colour_image("red"), "answer": "red"}
    green = {"prompt": vlm_prompt(), "image": colour_image("green"), "answer": "green"}
    rows = [red, red, red, green, green]  # 3 candidates of one question, 2 of another
    chosen = [completions[0], completions[1], completions[2], completions[0], completions[2]]
    calls = []
    tokenize = trainer._tokenize_prompts

    def counted(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return tokenize(prompts, *args, **kwargs)

    trainer._tokenize_prompts = counted
    scores = trainer._exgrpo_score_candidates(rows, [r["prompt"] for r in rows], chosen, [None] * 5)
    assert calls[0] == 2  # one prompt per question; the later calls are the scoring chunks' image inputs
    alone = [
        float(trainer._exgrpo_score_candidates([row], [row["prompt"]], [completion], [None])[0])
        for row, completion in zip(rows, chosen, strict=True)
    ]
    assert scores.tolist() == pytest.approx(alone, abs=1e-6)


def test_replay_ratio_zero_is_grpo_on_a_vlm(tmp_path):
    from trl import GRPOTrainer

    grpo = vlm_trainer(tmp_path / "grpo", cls=GRPOTrainer, max_steps=3)
    grpo.train()
    ex = vlm_trainer(tmp_path / "ex", replay_ratio=0.0, max_steps=3)
    ex.train()
    for (name, a), (_, b) in zip(grpo.model.named_parameters(), ex.model.named_parameters()):
        assert torch.equal(a, b), name


def test_replayed_rows_carry_their_question_image(tmp_path):
    """Replay from the first batch; every replayed group's K rows are its question's row, image included (their key,
    which holds the image's pixels, is the plan's key), and the stored trajectory's question is that image's."""
    trainer = vlm_trainer(tmp_path, replay_start_pass_rate=0.0, steps_per_generation=1, max_steps=6)
    run = trainer.exgrpo_run
    seen = []
    generation_batch = run.generation_batch

    @contextlib.contextmanager
    def recorded(inputs, score):
        with generation_batch(inputs, score) as batch:
            seen.append((batch.plan, [dict(x) for x in batch.rows.inputs]))
            yield batch

    run.generation_batch = recorded
    trainer.train()
    replayed = [(plan, rows) for plan, rows in seen if plan is not None]
    assert replayed, "nothing was replayed"
    for plan, rows in replayed:
        for j, group in enumerate(plan.group_indices):
            group_rows = rows[group * K : (group + 1) * K]
            assert {row_key(r) for r in group_rows} == {plan.keys[j]}
            assert all(r["image"] is not None for r in group_rows)
    assert all(row_key(e.row) == key for key, e in trainer.exgrpo_state.buffer.questions.items())


def test_resume_with_images_in_the_buffer_is_bitwise(tmp_path):
    straight = vlm_trainer(tmp_path / "a", replay_start_pass_rate=0.0, steps_per_generation=1, max_steps=6)
    straight.train()
    first = vlm_trainer(
        tmp_path / "b", replay_start_pass_rate=0.0, steps_per_generation=1, max_steps=6, save_strategy="steps",
        save_steps=3,
    )  # fmt: skip
    first.train()
    resumed = vlm_trainer(tmp_path / "b", replay_start_pass_rate=0.0, steps_per_generation=1, max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "out" / "checkpoint-3"))
    assert resumed.state.global_step == 6
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    assert list(resumed.exgrpo_state.buffer.questions) == list(straight.exgrpo_state.buffer.questions)
    assert resumed.exgrpo_state.buffer.num_trajectories == straight.exgrpo_state.buffer.num_trajectories


def test_a_vlm_checkpoint_holds_the_names_it_is_resumed_with(tmp_path):
    """Checkpoints of a model with a conversion mapping keep the model's own weight names (what Trainer's resume loads
    with a plain load_state_dict), and from_pretrained still reads them."""
    from safetensors.torch import load_file
    from transformers import Qwen2VLForConditionalGeneration

    from exgrpo_trl.compat import own_key_names as _own_key_names

    model, _ = build_tiny_vlm()
    model.save_pretrained(tmp_path / "plain")
    with _own_key_names(model):
        model.save_pretrained(tmp_path / "own")
    own = load_file(str(tmp_path / "own" / "model.safetensors"))
    assert set(own) == set(model.state_dict())
    assert set(load_file(str(tmp_path / "plain" / "model.safetensors"))) != set(own)  # transformers' own default
    loaded = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "own")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert "save_pretrained" not in vars(model)  # the method is the class's again


def test_export_inspect_and_seed_with_images(tmp_path):
    from exgrpo_trl.state_file import save_state

    """`exgrpo export` writes each question's images as a datasets Image list (its row holds references), `inspect
    --show` says how many images a question has, and seeding from the export restores the questions, keys and images
    exactly."""
    from datasets import load_from_disk

    from exgrpo_trl.cli.inspect import format_shown, show_questions
    from exgrpo_trl.export import buffer_dataset, export_meta, seed_buffer, tokenizer_fingerprint, write_export

    _, processor = build_tiny_vlm()
    tokenizer = processor.tokenizer
    buffer = ExperienceBuffer(K)
    eos = tokenizer.eos_token_id
    for colour, size in (("red", 28), ("blue", 56)):
        row = {"prompt": vlm_prompt(), "image": colour_image(colour, size), "answer": colour}
        ids = np.array([tokenizer.convert_tokens_to_ids(colour), eos])
        buffer.update_group(row_key(row), 2, row, [Trajectory(ids, np.array([-0.5, -0.25]), 3)])

    dataset = buffer_dataset(buffer, tokenizer, progress=False)
    assert "images" in dataset.features and dataset[0]["row"].count("exgrpo_image") == 1
    for record, entry in zip(dataset, buffer.questions.values()):
        (image,) = record["images"]
        assert image.tobytes() == entry.row["image"].tobytes() and image.size == entry.row["image"].size
    write_export(dataset, export_meta(buffer, tokenizer), tmp_path / "export")
    assert len(load_from_disk(str(tmp_path / "export"))) == 2

    seeded = ExperienceBuffer(K)
    seed_buffer(
        seeded,
        tmp_path / "export",
        fingerprint=tokenizer_fingerprint(tokenizer),
        tokenize=lambda text: tokenizer(text)["input_ids"],
        max_length=8,
        progress=False,
    )
    assert list(seeded.questions) == list(buffer.questions)
    assert all(row_key(e.row) == key for key, e in seeded.questions.items())

    checkpoint = tmp_path / "checkpoint-3"
    save_state(checkpoint, buffer, {"replay_active": True})
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    shown = show_questions(checkpoint, 2, str(tmp_path / "tokenizer"))
    assert [q["images"] for q in shown] == [1, 1]
    assert ", 1 image  (key" in format_shown(shown, 2, K)


def test_lora_on_a_vlm_replays_with_images(tmp_path):
    """A LoRA adapter on the VLM's attention: replay fires with images, only the adapter moves, and its checkpoint
    resumes (the adapter's weights are PEFT's to name: saved as they are)."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = vlm_trainer(
        tmp_path, peft_config=lora, replay_start_pass_rate=0.0, steps_per_generation=1, max_steps=4,
        save_strategy="steps", save_steps=2, learning_rate=1e-2,
    )  # fmt: skip
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    plans = []

    class Plans(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            plans.append(trainer.exgrpo_run.last_plan)

    trainer.add_callback(Plans())
    trainer.train()
    assert any(plan is not None for plan in plans)
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    assert any("lora" in n and p.requires_grad for n, p in trainer.model.named_parameters())
    resumed = vlm_trainer(
        tmp_path, peft_config=lora, replay_start_pass_rate=0.0, steps_per_generation=1, max_steps=4,
        learning_rate=1e-2,
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_exgrpo_train_on_image_data(tmp_path):
    """The installed `exgrpo train` command, in a fresh process (where nothing has imported exgrpo_trl.tasks.vision,
    whose import registers the tiny model's processor class), on the folders docs/cpu.md writes: the model's
    processor is loaded, the images are kept with their questions, replay runs, and the checkpoint's buffer holds the
    images."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from exgrpo_trl.state_file import load_checkpoint_buffer
    from exgrpo_trl.tasks.vision import save_tiny_vlm
    from tests.helpers import ROOT, TINY_RECIPE

    save_tiny_vlm(tmp_path / "vlm-model")
    colour_dataset(64, seed=1).save_to_disk(str(tmp_path / "vlm-data"))
    documented = (ROOT / "docs" / "cpu.md").read_text().split("then `exgrpo train ")[1].split("`")[0].split()
    assert documented[:2] == ["--config", "recipes/tiny_cpu.yaml"]
    command = [str(Path(sys.executable).with_name("exgrpo")), "train", "--config", str(TINY_RECIPE), *documented[2:],
               "--output_dir", "out", "--max_steps", "4", "--save_steps", "4", "--logging_steps", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    buffer = load_checkpoint_buffer(tmp_path / "out" / "checkpoint-4")
    assert buffer.num_questions > 0
    assert all(row_key(e.row) == key and e.row["image"] is not None for key, e in buffer.questions.items())
