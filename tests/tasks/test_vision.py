"""The image task of `exgrpo_trl.tasks.vision` (the CPU try-out with images): its answer is only in the image, and
shading makes every row its own question."""

from __future__ import annotations

from exgrpo_trl.tasks.vision import COLOURS, QUESTION, colour_dataset, colour_reward


def test_shades_make_each_image_its_own_question_with_the_same_answers():
    plain, shaded = colour_dataset(40, seed=3), colour_dataset(40, seed=3, shades=40)
    assert plain["answer"] == shaded["answer"]  # the colours are drawn first, the shades after
    assert {p[0]["content"][1]["text"] for p in shaded["prompt"]} == {QUESTION}  # the text never tells
    pixels = [image.getpixel((0, 0)) for image in shaded["image"]]
    assert len(set(pixels)) == 40  # 40 images, 40 questions (ExGRPO keys a question by its pixels)
    assert len({image.getpixel((0, 0)) for image in plain["image"]}) == len(set(plain["answer"])) <= len(COLOURS)
    for pixel, answer in zip(pixels, shaded["answer"], strict=True):
        assert all(abs(c - b) <= 40 and 0 <= c <= 255 for c, b in zip(pixel, COLOURS[answer], strict=True))
    for image in shaded["image"]:  # one colour over the whole square
        assert len(set(image.getdata())) == 1


def test_colour_reward_reads_the_colour_word():
    completions = ["It is red.", "the image is blue", "I see green", [{"role": "assistant", "content": "Red"}]]
    assert colour_reward(completions, answer=["red", "red", "green", "red"]) == [1.0, 0.0, 1.0, 1.0]
