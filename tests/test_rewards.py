"""Rewards: registry, weights, JPEG, CLIP-based (tiny random CLIP), OCR (real Tesseract), HTTP."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import re
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from transformers import CLIPProcessor

from conftest import tiny_config
from jagg_core.config import RewardSpec
from jagg_core.errors import UserError
from jagg_core.images import to_pil
from jagg_core.rewards import available_rewards, build_reward, build_rewards
from jagg_core.rewards import catalog
from jagg_core.rewards import clip as clip_rewards
from jagg_core.rewards.catalog import reward_entry
from jagg_core.rewards.clip import AestheticHead
from jagg_core.rewards.jpeg import jpeg_size_kb
from jagg_core.rewards.ocr import levenshtein, quoted_text, text_match


def spec(name, weight=1.0, **options):
    return RewardSpec(name=name, weight=weight, options=options)


def flat_and_noise(size=64):
    torch.manual_seed(0)
    return torch.stack([torch.full((3, size, size), 0.5), torch.rand(3, size, size)])


# --- registry and combination -------------------------------------------------------------

def test_registry_lists_the_rewards_of_the_issue():
    assert {"jpeg_compressibility", "jpeg_incompressibility", "aesthetic", "clip_score", "pickscore",
            "hpsv2", "image_reward", "ocr", "http"} <= set(available_rewards())


def test_every_catalog_entry_loads_its_class_under_its_name():
    for name in available_rewards():
        cls = reward_entry(name).load_class()
        assert cls.name == name and callable(cls)


def test_option_types_are_checked_before_any_model_loads():
    with pytest.raises(UserError, match=r"bad value 5 for options.url of reward 'http'"):
        build_rewards([spec("http", url=5)])
    with pytest.raises(UserError, match=r"bad value 'abc' for options.timeout of reward 'http'"):
        build_rewards([spec("http", url="http://localhost:1", timeout="abc")])
    with pytest.raises(UserError, match=r"options.timeout of reward 'http'"):
        build_rewards([spec("http", url="http://localhost:1", timeout=float("inf"))])


def test_unknown_reward_and_option_are_one_line_user_errors():
    with pytest.raises(UserError, match=r"unknown reward 'nope'; available: .*jpeg_compressibility"):
        build_rewards([spec("nope")])
    with pytest.raises(UserError, match=r"unknown option\(s\) colour for reward 'clip_score'; "
                                        r"allowed: fit, model_id, processor_id"):
        build_rewards([spec("clip_score", colour="red")])


@pytest.mark.parametrize("overrides, message", [
    (["prompts.source={text}"], "the reward 'shapes' cannot read the prompt 'a "),
    (["prompts.source={text}", "rewards=[{name: jpeg_compressibility}]"],
     "the judge 'shapes_fidelity' (eval.judges) cannot read the prompt"),
    (["prompts.source=shapes", "prompts.eval_source={text}"], "the reward 'shapes' cannot read the prompt"),
])
def test_a_reward_that_reads_a_prompt_grammar_refuses_other_prompts_before_launch(overrides, message, tmp_path):
    from jagg_core.config import load_config
    from jagg_core.preflight import check_references
    text = tmp_path / "prompts.txt"
    text.write_text("".join(f"a red car number {i}\n" for i in range(100)))
    config = load_config(preset="shapes", overrides=[o.replace("{text}", str(text)) for o in overrides])
    with pytest.raises(UserError) as err:
        check_references(config)
    assert message in str(err.value) and "the built-in prompt set shapes follows it" in str(err.value)


def test_a_judge_reads_only_the_held_out_prompts_it_scores(tmp_path):
    from jagg_core.config import load_config
    from jagg_core.preflight import check_references
    text = tmp_path / "prompts.txt"
    text.write_text("".join(f"a red car number {i}\n" for i in range(100)))
    config = load_config(preset="shapes", overrides=[f"prompts.source={text}", "prompts.eval_source=shapes",
                                                     "rewards=[{name: jpeg_compressibility}]"])
    assert [judge.name for judge in config.eval.judges] == ["shapes_fidelity"]
    check_references(config)


def test_combined_reward_is_the_weighted_sum_of_its_parts():
    images, prompts = flat_and_noise(), ["a", "b"]
    combined = build_rewards([spec("jpeg_compressibility", 2.0), spec("jpeg_incompressibility", -0.5),
                              spec("jpeg_compressibility", 0.25)])
    total, parts = combined(images, prompts)
    assert combined.names == ["jpeg_compressibility", "jpeg_incompressibility", "jpeg_compressibility_2"]
    size = jpeg_size_kb(images)
    torch.testing.assert_close(parts["jpeg_compressibility"], -size)
    torch.testing.assert_close(parts["jpeg_incompressibility"], size)
    torch.testing.assert_close(total, 2.0 * -size - 0.5 * size + 0.25 * -size)
    assert total.dtype == torch.float32 and total.shape == (2,)


def test_jpeg_rewards_prefer_flat_or_busy_images():
    images = flat_and_noise()
    small = build_reward(spec("jpeg_compressibility"))(images, ["", ""])
    large = build_reward(spec("jpeg_incompressibility"))(images, ["", ""])
    assert small[0] > small[1] and large[1] > large[0]
    buffer = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(buffer, format="JPEG", quality=95)
    assert small[0].item() == pytest.approx(-len(buffer.getvalue()) / 1000)


# --- CLIP-based rewards on a tiny random CLIP saved to disk (conftest.tiny_clip) -------------------------------

def reference_logits(folder, images, prompts):
    """``logits_per_image`` of the plain transformers forward, one row per image."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(folder).eval(), CLIPProcessor.from_pretrained(folder)
    pil = [Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)) for img in images]
    with torch.no_grad():
        out = model(**processor(text=prompts, images=pil, padding=True, return_tensors="pt"))
    return out.logits_per_image, model.logit_scale.exp()


def test_clip_score_and_pickscore_match_the_clip_forward(tiny_clip):
    folder, _ = tiny_clip
    images, prompts = flat_and_noise(48), ["a red cat", "blue sky"]
    logits, scale = reference_logits(folder, images, prompts)
    clip_score = build_reward(spec("clip_score", model_id=folder))(images, prompts)
    pick = build_reward(spec("pickscore", model_id=folder, processor_id=folder))(images, prompts)
    torch.testing.assert_close(clip_score, logits.diagonal() / scale, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pick, logits.diagonal(), atol=1e-4, rtol=1e-4)
    assert clip_score.abs().max() <= 1


def test_aesthetic_reads_the_laion_head_format(tiny_clip, tmp_path):
    folder, head = tiny_clip
    laion_keys = [f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")]
    assert list(AestheticHead().state_dict()) == laion_keys
    images = flat_and_noise(32)
    scores = build_reward(spec("aesthetic", model_id=folder, head=head))(images, ["", ""])
    assert scores.shape == (2,) and torch.isfinite(scores).all() and scores[0] != scores[1]
    shifted = torch.load(head)
    shifted["layers.7.bias"] += 1.0
    torch.save(shifted, tmp_path / "shifted.pth")
    moved = build_reward(spec("aesthetic", model_id=folder, head=str(tmp_path / "shifted.pth")))(images, ["", ""])
    torch.testing.assert_close(moved, scores + 1.0)


def centred_on_a_square(images: torch.Tensor, fill) -> torch.Tensor:
    """``[N, 3, H, W]`` centred on a square of their longest side filled with ``fill`` (8-bit, as the rewards'
    pictures), the longer side's odd pixel of padding after the image, as PIL's ``ImageOps.pad`` places it."""
    height, width = images.shape[-2:]
    side = max(height, width)
    square = torch.tensor([round(255 * c) / 255 for c in fill]).view(1, 3, 1, 1).repeat(len(images), 1, side, side)
    top, left = (side - height) // 2, (side - width) // 2
    square[..., top:top + height, left:left + width] = images
    return square


@pytest.mark.parametrize("height, width", [(32, 64), (64, 40)])
def test_a_wide_or_tall_sample_is_scored_whole_and_with_fit_crop_at_its_centre_only(tiny_clip, height, width):
    """With the processor's centre crop alone, a wide sample's sides are never scored, so RL leaves them untrained
    and favours subjects in the centre: by default the CLIP rewards read the whole sample, centred on a square of
    the model's mean colour."""
    folder, _ = tiny_clip
    torch.manual_seed(1)
    images, prompts = torch.rand(2, 3, height, width), ["a red cat", "blue sky"]
    sides = images.clone()
    if width > height:  # the long side's first 4 pixels: the left edge of a wide sample, the top of a tall one
        sides[..., :4] = 0.0
    else:
        sides[..., :4, :] = 0.0
    whole, crop = build_reward(spec("clip_score", model_id=folder)), build_reward(spec("clip_score", model_id=folder,
                                                                                        fit="crop"))
    mean = CLIPProcessor.from_pretrained(folder).image_processor.image_mean
    logits, scale = reference_logits(folder, centred_on_a_square(images, mean), prompts)
    torch.testing.assert_close(whole(images, prompts), logits.diagonal() / scale, atol=1e-5, rtol=1e-4)
    assert (whole(sides, prompts) - whole(images, prompts)).abs().min() > 1e-4
    torch.testing.assert_close(crop(sides, prompts), crop(images, prompts))  # the edges lie outside its crop
    square = torch.rand(2, 3, 48, 48)
    torch.testing.assert_close(whole(square, prompts), crop(square, prompts))


@pytest.mark.parametrize("options, padded", [({}, True), ({"fit": "crop"}, False)])
def test_hpsv2_and_image_reward_give_their_packages_the_whole_sample_or_the_uncut_one(options, padded):
    """Their packages' preprocessing (a resize and centre crop) gets each picture centred on a square of CLIP's
    mean colour (fit pad, the default), or as it is (crop)."""
    from transformers.image_utils import OPENAI_CLIP_MEAN

    images = torch.rand(2, 3, 32, 64)
    expected = to_pil(centred_on_a_square(images, OPENAI_CLIP_MEAN) if padded else images)
    seen = []
    hps = build_reward(spec("hpsv2", **options))
    features = {"image_features": torch.ones(2, 4), "text_features": torch.ones(2, 4)}
    hps.__dict__["model"] = (lambda pixels, tokens: features,
                             lambda picture: seen.append(picture) or torch.zeros(3, 4, 4),
                             lambda prompts: torch.zeros(len(prompts), 3, dtype=torch.long))
    hps(images, ["a", "b"])
    image_reward = build_reward(spec("image_reward", **options))
    image_reward.__dict__["model"] = type("Scorer", (), {"score": lambda self, prompt, picture: seen.append(picture)
                                                         or 0.0})()
    image_reward(images, ["a", "b"])
    assert [np.asarray(p).tolist() for p in seen] == [np.asarray(p).tolist() for p in expected * 2]


def test_models_load_lazily_and_once(tiny_clip, monkeypatch):
    folder, _ = tiny_clip
    calls = []
    real = clip_rewards.load_clip
    monkeypatch.setattr(clip_rewards, "load_clip", lambda *args: calls.append(args) or real(*args))
    reward = build_reward(spec("clip_score", model_id=folder))
    assert calls == []
    reward(flat_and_noise(32), ["a", "b"])
    reward(flat_and_noise(32), ["c", "d"])
    assert len(calls) == 1


@pytest.mark.parametrize("name,options,model_id", [
    ("clip_score", {"model_id": "jagg-test/no-such-clip"}, "jagg-test/no-such-clip"),
    ("pickscore", {}, "yuvalkirstain/PickScore_v1"),
    ("aesthetic", {}, "openai/clip-vit-large-patch14"),
    ("vqa_score", {}, "Qwen/Qwen2.5-VL-3B-Instruct"),
    ("geneval", {}, "IDEA-Research/grounding-dino-tiny"),
])
def test_offline_without_weights_is_a_one_line_error(name, options, model_id, monkeypatch, tmp_path):
    monkeypatch.setitem(catalog.CATALOG, name, replace(reward_entry(name), requires=()))  # as if torchvision were here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    reward = build_reward(spec(name, **options))
    with pytest.raises(UserError) as err:
        reward(flat_and_noise(32), ["a photo of a dog", "a photo of two cats"])  # prompts geneval reads too
    message = str(err.value)
    assert "\n" not in message and f"'{model_id}'" in message and f"hf download {model_id}" in message


def test_aesthetic_head_offline_names_its_repo(tiny_clip, monkeypatch, tmp_path):
    folder, _ = tiny_clip
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    reward = build_reward(spec("aesthetic", model_id=folder))
    with pytest.raises(UserError, match="hf download camenduru/improved-aesthetic-predictor"):
        reward(flat_and_noise(32), ["a", "b"])


@pytest.mark.parametrize("name,module,package", [("hpsv2", "hpsv2", "hpsv2"),
                                                 ("image_reward", "ImageReward", "image-reward")])
def test_missing_optional_package_says_how_to_install(name, module, package, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)
    reward = build_reward(spec(name))
    with pytest.raises(UserError, match=f"pip install {package}"):
        reward(flat_and_noise(32), ["a", "b"])


def test_bad_hpsv2_version_is_rejected():
    with pytest.raises(UserError, match="bad value .v3. for options.version of reward .hpsv2.: Input should be .v2.0. or .v2.1."):
        build_reward(spec("hpsv2", version="v3"))


# --- VQAScore (a tiny random Qwen2.5-VL) -------------------------------------------------------------------------

#: a Qwen2-VL-style chat template: user turns of images and text, then the assistant's turn
VL_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
                    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
                    "<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_vlm():
    """A tiny random Qwen2.5-VL chat model and its processor, "Yes" one token of its tokenizer."""
    from jagg_core.models.in_memory_parts import (QWEN_VISION_TOKENS, tiny_qwen_processor, tiny_qwen_tokenizer,
                                                  tiny_qwen_vl_encoder)
    tokenizer = tiny_qwen_tokenizer("Yes No", tuple(QWEN_VISION_TOKENS.values()))
    processor = tiny_qwen_processor(tokenizer)
    processor.chat_template = VL_CHAT_TEMPLATE
    processor.tokenizer.padding_side = "left"
    torch.manual_seed(0)
    model = tiny_qwen_vl_encoder(tokenizer).eval()
    with torch.no_grad():  # weights 5x their initial scale: the pictures move the answer far beyond float noise
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.mul_(5)
    return model, processor


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory) -> str:
    """A tiny random LLaVA chat model saved with its processor (a CLIP image processor, which needs no torchvision):
    a model folder as ``AutoModelForImageTextToText`` and ``AutoProcessor`` read it."""
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from jagg_core.models.in_memory_parts import tiny_qwen_tokenizer
    tokenizer = tiny_qwen_tokenizer("Yes No", ("<image>",))
    template = VL_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-1,
                                                      image_token_index=tokenizer.convert_tokens_to_ids("<image>")))
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               image_token="<image>", vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=template)
    folder = tmp_path_factory.mktemp("tiny-llava")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


def vqa_reward(tiny_vlm, **options):
    reward = build_reward(spec("vqa_score", **options))
    reward.__dict__["vlm"] = tiny_vlm  # what load_vlm returns for a model folder (it needs torchvision here)
    return reward


def generated_yes_probability(vlm, pictures: torch.Tensor, question: str) -> torch.Tensor:
    """The probability of "Yes" as the first token ``generate`` replies to the question about ``pictures``."""
    model, processor = vlm
    text = processor.apply_chat_template([{"role": "user", "content": [*[{"type": "image"}] * len(pictures),
                                                                        {"type": "text", "text": question}]}],
                                         add_generation_prompt=True, tokenize=False)
    with torch.no_grad():
        out = model.generate(**processor(text=[text], images=to_pil(pictures), return_tensors="pt"),
                             max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.logits[0][0].float().softmax(-1)[processor.tokenizer.convert_tokens_to_ids("Yes")]


@pytest.mark.parametrize("edit", [False, True])
def test_vqa_score_is_the_probability_of_yes_as_generate_sees_it_whatever_the_batch(tiny_vlm, edit):
    """Three images of prompts of different lengths, two a forward pass (left padding): each score is the softmax
    of the first reply token's logits at "Yes", as ``generate`` computes them for the image alone (an edit: shown
    its input image, then the output, asked the edit question)."""
    torch.manual_seed(1)
    images, prompts = torch.rand(3, 3, 64, 64), ["a red circle", "two blue squares on the left", "a cat"]
    inputs = torch.rand(3, 3, 64, 64) if edit else None
    reward = vqa_reward(tiny_vlm, batch_size=2)
    scores = reward(images, prompts, inputs)
    question = catalog.VQA_EDIT_QUESTION if edit else catalog.VQA_QUESTION
    for i, prompt in enumerate(prompts):
        pictures = torch.stack([inputs[i], images[i]]) if edit else images[i:i + 1]
        expected = generated_yes_probability(tiny_vlm, pictures, question.format(prompt=prompt))
        torch.testing.assert_close(scores[i], expected, atol=1e-8, rtol=2e-5)
    assert scores.shape == (3,) and ((scores > 0) & (scores < 1)).all()
    other = {"edit_question": "Edited: {prompt}?"} if edit else {"question": "Is this {prompt}?"}
    assert not torch.allclose(scores, vqa_reward(tiny_vlm, **other)(images, prompts, inputs))
    if edit:  # the input image is seen
        assert not torch.allclose(scores, reward(images, prompts, inputs.flip(0)))


def test_an_editing_row_is_asked_about_its_instruction_with_its_input_image(tiny_vlm):
    """Through the rewards' combination, as a run calls it: each row's instruction (not the row's text) and its
    input image at the output's size."""
    from jagg_core.edit_prompts import EditPrompt, input_images, png_bytes
    from jagg_core.image_size import ImageSize
    from jagg_core.rewards import CombinedReward
    torch.manual_seed(2)
    pictures, images = torch.rand(2, 3, 80, 80), torch.rand(2, 3, 64, 64)
    rows = [EditPrompt(text, png_bytes(picture), f"in{i}.png")
            for i, (text, picture) in enumerate(zip(["make it blue", "add a hat"], to_pil(pictures)))]
    reward = vqa_reward(tiny_vlm)
    total, parts = CombinedReward([reward], [1.0], ["vqa_score"])(images, rows)
    expected = reward(images, ["make it blue", "add a hat"], input_images(rows, ImageSize.square(64)))
    torch.testing.assert_close(parts["vqa_score"], expected)
    torch.testing.assert_close(total, expected)
    assert not torch.allclose(expected, reward(images, ["make it blue", "add a hat"]))


def test_a_vlm_folder_loads_with_its_own_processor_and_scores_as_generate_does(tiny_llava, monkeypatch):
    """The real loading path on a model folder (another architecture than Qwen2.5-VL): its model and processor load,
    the tokenizer pads on the left, and the scores are the probabilities of "Yes" that ``generate`` sees."""
    from transformers import LlavaForConditionalGeneration
    monkeypatch.setitem(catalog.CATALOG, "vqa_score", replace(reward_entry("vqa_score"), requires=()))
    torch.manual_seed(3)
    images, prompts = torch.rand(3, 3, 32, 32), ["a red circle", "two blue squares on the left", "a cat"]
    reward = build_reward(spec("vqa_score", model_id=tiny_llava, batch_size=2))
    scores = reward(images, prompts)
    model, processor = reward.vlm
    assert isinstance(model, LlavaForConditionalGeneration) and processor.tokenizer.padding_side == "left"
    for i, prompt in enumerate(prompts):
        expected = generated_yes_probability(reward.vlm, images[i:i + 1], catalog.VQA_QUESTION.format(prompt=prompt))
        torch.testing.assert_close(scores[i], expected, atol=1e-8, rtol=2e-5)


@pytest.mark.parametrize("options, message", [
    ({"question": "Is this an image?"}, "must hold {prompt}"),
    ({"question": "Is this {prompt} {x}?"}, "may hold no braces but {prompt}"),
    ({"batch_size": 0}, "options.batch_size"),
])
def test_vqa_options_are_checked_before_any_model_loads(options, message):
    with pytest.raises(UserError, match=re.escape(message)):
        build_reward(spec("vqa_score", **options))


def test_a_vqa_answer_of_several_tokens_is_one_line(tiny_vlm):
    with pytest.raises(UserError, match="the vqa_score answer 'Certainly' is 9 tokens .* such as Yes$"):
        vqa_reward(tiny_vlm, answer="Certainly")(torch.rand(1, 3, 64, 64), ["a cat"])


def test_a_reward_whose_package_is_missing_is_refused_before_launch_and_before_it_loads(monkeypatch, tmp_path):
    """vqa_score's Qwen2.5-VL processor needs torchvision: a launch is refused in one line (a plan or a dry run is
    not), and so is loading the reward."""
    from jagg_core.preflight import check_references
    from jagg_core.rewards.vqa import load_vlm
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else
                        find_spec(name, *a))
    config = tiny_config(eval__judges=[{"name": "vqa_score"}])
    message = "the vqa_score reward needs torchvision, which is not installed: pip install torchvision"
    with pytest.raises(UserError, match=re.escape(message)):
        check_references(config)
    check_references(config, disk=False)
    with pytest.raises(UserError, match=re.escape(message)):
        load_vlm("Qwen/Qwen2.5-VL-3B-Instruct", torch.device("cpu"))


def test_a_model_that_is_not_a_chat_vision_language_model_is_one_line(tiny_clip, monkeypatch):
    monkeypatch.setitem(catalog.CATALOG, "vqa_score", replace(reward_entry("vqa_score"), requires=()))
    folder, _ = tiny_clip
    with pytest.raises(UserError, match=f"^'{re.escape(folder)}' is not a chat vision-language model .* "
                                        r"Qwen/Qwen2.5-VL-3B-Instruct \(options.model_id\)$"):
        build_reward(spec("vqa_score", model_id=folder))(flat_and_noise(32), ["a", "b"])


def test_the_plan_holds_a_vqa_judge_in_bfloat16():
    from jagg_core.memory_plan import plan_memory
    settings = dict(sampling__resolution=64, grpo__num_generations=4)
    plain = plan_memory(tiny_config(**settings))
    judged = plan_memory(tiny_config(**settings, eval__judges=[{"name": "vqa_score"}]))
    assert judged.resident["judge vqa_score (3755 M, bfloat16)"] == 3755e6 * 2
    assert judged.total - plain.total == pytest.approx(3755e6 * 2)


# --- OCR with the real Tesseract ----------------------------------------------------------

def sign(text: str) -> torch.Tensor:
    image = Image.new("RGB", (320, 128), "white")
    ImageDraw.Draw(image).text((20, 24), text, fill="black", font=ImageFont.load_default(size=64))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


def test_text_matching_formula():
    assert quoted_text('a sign that says "Hello" and \u201cWorld\u201d') == "Hello World"
    assert quoted_text("no quotes") == ""
    assert levenshtein("kitten", "sitting") == 3
    assert text_match("HELLO", "hel lo") == 1.0
    assert text_match("HELLO", "HELP") == pytest.approx(1 - 2 / 5)
    assert text_match("HI", "something else entirely") == 0.0


def test_ocr_reads_drawn_text():
    reward = build_reward(spec("ocr"))
    images = torch.stack([sign("HELLO"), sign("HELLO")])
    scores = reward(images, ['a sign that says "HELLO"', 'a sign that says "QUARTZ"'])
    assert scores[0] >= 0.8 and scores[1] <= 0.5


def test_ocr_needs_quoted_text():
    with pytest.raises(UserError, match="double quotes"):
        build_reward(spec("ocr"))(sign("HI")[None], ["a sign"])


# --- HTTP reward server -------------------------------------------------------------------

class Server:
    """A local reward server; ``answer(body) -> (status, text)`` decides what it sends back (text: a string, or an
    iterable of byte chunks sent one by one, e.g. slowly)."""

    def __init__(self, answer):
        self.requests = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                status, text = answer(body)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                try:
                    for chunk in [text.encode()] if isinstance(text, str) else text:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except OSError:  # the client gave up
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    servers = []

    def start(answer):
        servers.append(Server(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_http_reward_posts_pngs_and_prompts(server):
    def mean_brightness(body):
        images = [Image.open(io.BytesIO(base64.b64decode(b))) for b in body["images"]]
        return 200, json.dumps({"scores": [float(np.asarray(im).mean() / 255) for im in images]})

    srv = server(mean_brightness)
    images = torch.stack([torch.full((3, 16, 24), 0.2), torch.full((3, 16, 24), 0.8)])
    scores = build_reward(spec("http", url=srv.url))(images, ["dark", "light"])
    torch.testing.assert_close(scores, torch.tensor([51 / 255, 204 / 255]))
    assert srv.requests[0]["prompts"] == ["dark", "light"]


@pytest.mark.parametrize("answer,match", [
    ((200, "not json"), "must answer"),
    ((200, '{"score": [1, 2]}'), "must answer"),
    ((200, '{"scores": "77"}'), "must answer"),
    ((404, "no such route"), "HTTP 404"),
])
def test_http_bad_answers_are_user_errors(server, answer, match):
    srv = server(lambda body: answer)
    with pytest.raises(UserError, match=match):
        build_reward(spec("http", url=srv.url, retries=0))(flat_and_noise(16), ["a", "b"])


def test_http_retries_server_errors_then_gives_up(server):
    srv = server(lambda body: (503, "busy"))
    with pytest.raises(UserError, match=r"not answering \(HTTP 503 after 3 attempts within 60 s\)"):
        build_reward(spec("http", url=srv.url, retries=2, retry_delay=0))(flat_and_noise(16), ["a", "b"])
    assert len(srv.requests) == 3


def test_http_recovers_after_a_failed_attempt(server):
    answers = iter([(500, "oops"), (200, '{"scores": [3, 4]}')])
    srv = server(lambda body: next(answers))
    scores = build_reward(spec("http", url=srv.url, retry_delay=0))(flat_and_noise(16), ["a", "b"])
    assert scores.tolist() == [3.0, 4.0]


def test_http_server_down_is_a_user_error(server):
    srv = server(lambda body: (200, "{}"))
    url = srv.url
    srv.close()
    with pytest.raises(UserError, match=r"is not answering \(ConnectionError after 2 attempts within 2 s\); is it running\?"):
        build_reward(spec("http", url=url, retries=1, retry_delay=0, timeout=2))(flat_and_noise(16), ["a", "b"])


def test_http_needs_a_url():
    with pytest.raises(UserError, match="options.url"):
        build_reward(spec("http"))


@pytest.mark.parametrize("answer", ['{"scores": [1]}', '{"scores": [1, NaN]}', '{"scores": [1, null]}'])
def test_http_missing_or_non_finite_scores_are_nan_so_the_update_is_skipped(server, answer):
    srv = server(lambda body: (200, answer))
    reward = build_reward(spec("http", url=srv.url, retries=0))
    if answer == '{"scores": [1]}':
        with pytest.warns(UserWarning, match="returned 1 scores for 2 images; this update is skipped"):
            scores = reward(flat_and_noise(16), ["a", "b"])
        assert torch.isnan(scores).all()
    else:
        scores = reward(flat_and_noise(16), ["a", "b"])
        assert scores[0] == 1.0 and torch.isnan(scores[1])


def test_http_timeout_is_a_total_deadline_not_per_read(server):
    def trickle(body):
        def chunks():
            yield b'{"scores": [1, 2]'
            for _ in range(200):  # a byte every 0.1 s: 20 s in all, each read well within a per-read time-out
                time.sleep(0.1)
                yield b" "
            yield b"}"
        return 200, chunks()
    srv = server(trickle)
    with pytest.raises(UserError, match=r"not answering \(Timeout after 1 attempts within 1 s\)"):
        build_reward(spec("http", url=srv.url, retries=0, timeout=1))(flat_and_noise(16), ["a", "b"])


def test_http_reply_size_is_capped(server):
    srv = server(lambda body: (200, (b" " * (1 << 20) for _ in range(20))))
    with pytest.raises(UserError, match="sent more than 16 MB"):
        build_reward(spec("http", url=srv.url, retries=0))(flat_and_noise(16), ["a", "b"])


def test_the_catalog_says_which_rewards_score_whole_videos_as_their_classes_do():
    """``videos_only`` (read before launch, torch-free) is each class's ``takes_videos`` (read as it scores)."""
    from jagg_core.rewards.catalog import CATALOG
    assert {name for name, entry in CATALOG.items() if entry.load_class().takes_videos} == {
        name for name, entry in CATALOG.items() if entry.videos_only} == {"temporal_consistency", "motion"}
