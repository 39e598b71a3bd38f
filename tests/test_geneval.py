"""The geneval reward: the prompts' requirements, GenEval's checks on planted boxes, and the detector's path on a tiny
random Grounding DINO saved as a model folder."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import run_cli, tiny_config
from jagg_core.config import RewardSpec
from jagg_core.errors import UserError
from jagg_core.object_prompts import ObjectRequirement, PromptRequirements, read_prompt, read_prompts, singular
from jagg_core.rewards import build_reward
from jagg_core.rewards.geneval import BOX_RELATIONS, box_relations, pixel_box, without_duplicates, without_groups
from jagg_core.rundir import RunDirectory

COMPOSITIONAL = Path(__file__).resolve().parent.parent / "presets" / "prompts" / "compositional.txt"


def geneval(**options):
    return build_reward(RewardSpec(name="geneval", options=options))


@pytest.fixture(scope="module")
def tiny_detector(tmp_path_factory):
    """A tiny random Grounding DINO (its Swin backbone and BERT text encoder too) with its processor, saved as a model
    folder, as AutoModelForZeroShotObjectDetection and AutoProcessor load it."""
    from transformers import (BertConfig, BertTokenizer, GroundingDinoConfig, GroundingDinoForObjectDetection,
                              GroundingDinoProcessor, SwinConfig)
    from transformers.models.grounding_dino.image_processing_pil_grounding_dino import GroundingDinoImageProcessorPil

    folder = tmp_path_factory.mktemp("tiny-grounding-dino")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *"abcdefghijklmnopqrstuvwxyz", "dog", "cat", "car",
             "cup", "teddy", "bear", "bowl"]
    (folder / "vocab.txt").write_text("\n".join(words))
    tokenizer = BertTokenizer(str(folder / "vocab.txt"))
    config = GroundingDinoConfig(
        backbone_config=SwinConfig(window_size=7, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                                   image_size=32, out_features=["stage2", "stage3", "stage4"], out_indices=[2, 3, 4]),
        text_config=BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=37),
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        encoder_attention_heads=2, decoder_attention_heads=2, num_queries=12, encoder_n_points=2, decoder_n_points=2,
        max_text_len=32)
    torch.manual_seed(0)
    GroundingDinoForObjectDetection(config).eval().save_pretrained(folder)
    image_processor = GroundingDinoImageProcessorPil(size={"shortest_edge": 128, "longest_edge": 128})
    GroundingDinoProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return str(folder)


# --- the prompts ---------------------------------------------------------------------------------------------------

def test_the_grammar_reads_genevals_templates_and_the_compositional_set():
    one = dict(count=1, exact=False)
    assert read_prompt("a photo of a bench") == PromptRequirements((ObjectRequirement("bench", **one),))
    assert read_prompt("A photo of four giraffes.") == PromptRequirements((ObjectRequirement("giraffe", 4, True),))
    assert read_prompt("a photo of a red car and a blue bowl") == PromptRequirements(
        (ObjectRequirement("car", 1, False, "red"), ObjectRequirement("bowl", 1, False, "blue")))
    assert read_prompt("a photo of a dog right of a teddy bear") == PromptRequirements(
        (ObjectRequirement("dog", **one), ObjectRequirement("teddy bear", **one)), "right of")
    assert read_prompt("three white chairs on top of a book on a table") == PromptRequirements(
        (ObjectRequirement("chair", 3, True, "white"), ObjectRequirement("book", **one)), "above")
    assert read_prompt("a cat to the left of a dog").relation == "left of"
    assert read_prompt("two red balls under a lamp").relation == "below"
    assert read_prompt("a dog in front of five cats") == PromptRequirements(
        (ObjectRequirement("dog", **one), ObjectRequirement("cat", 5, True)))
    prompts = COMPOSITIONAL.read_text().splitlines()
    relations = [requirements.relation for requirements in read_prompts(prompts)]
    assert len(relations) == 320 and {"left of", "right of", "above", "below", None} == set(relations)


def test_the_geneval_set_is_genevals_six_templates_over_cocos_80_classes():
    from jagg_core.prompts import load_prompts
    read = read_prompts(load_prompts("geneval"))
    kinds = Counter()
    for requirements in read:
        first = requirements.objects[0]
        kinds[("two objects" if len(requirements.objects) == 2 else "one object",
               requirements.relation or ("counting" if first.exact else "colour" if first.colour else "plain"))] += 1
    assert kinds == {("one object", "plain"): 80, ("one object", "counting"): 200, ("one object", "colour"): 200,
                     ("two objects", "plain"): 200, ("two objects", "colour"): 200,  # colour attribution
                     **{("two objects", r): 50 for r in BOX_RELATIONS}}
    assert len({item.noun for requirements in read for item in requirements.objects}) == 80
    assert Counter(requirements.task for requirements in read) == {
        "single_object": 80, "two_object": 200, "counting": 200, "colors": 200, "position": 200, "color_attr": 200}


@pytest.mark.parametrize("plural, noun", [("teddy bears", "teddy bear"), ("wine glasses", "wine glass"),
                                          ("boxes", "box"), ("puppies", "puppy"), ("knives", "knife"),
                                          ("people", "person"), ("vases", "vase"), ("buses", "bus")])
def test_a_counted_objects_noun_is_asked_for_in_the_singular(plural, noun):
    assert singular(plural) == noun and read_prompt(f"a photo of two {plural}").objects[0].noun == noun


def test_a_prompt_outside_the_grammar_is_refused_before_launch_in_one_line(tmp_path):
    from jagg_core.preflight import check_references
    text = tmp_path / "prompts.txt"
    text.write_text("\n".join([*COMPOSITIONAL.read_text().splitlines()[:8], "a cat on a chair"]))
    config = tiny_config(rewards=[{"name": "geneval"}], prompts__source=str(text))
    with pytest.raises(UserError) as err:
        check_references(config)
    message = str(err.value)
    assert "\n" not in message and "the reward 'geneval' cannot read the prompt 'a cat on a chair'" in message
    assert "the built-in prompt sets geneval and compositional follow it" in message
    check_references(tiny_config(rewards=[{"name": "geneval"}], prompts__source="compositional"))


# --- GenEval's checks on planted boxes -----------------------------------------------------------------------------

def boxes(*corners):
    return torch.tensor(corners, dtype=torch.float32).reshape(-1, 4)


def test_relations_read_the_shortened_offset_of_the_centres():
    left, right = boxes(0, 40, 20, 60)[0], boxes(60, 40, 80, 60)[0]
    assert box_relations(left, right, 0.1) == {"left of"} and box_relations(right, left, 0.1) == {"right of"}
    top, bottom = boxes(40, 0, 60, 20)[0], boxes(40, 60, 60, 80)[0]
    assert box_relations(top, bottom, 0.1) == {"above"} and box_relations(bottom, top, 0.1) == {"below"}
    assert box_relations(boxes(0, 0, 20, 20)[0], boxes(60, 60, 80, 80)[0], 0.1) == {"left of", "above"}  # diagonal
    # boxes 40 px wide: the margin 0.1 x 80 = 8 px; centres 30 px apart leave 22 px along x, 22 / 30 > 1/2
    assert box_relations(boxes(0, 0, 40, 40)[0], boxes(30, 0, 70, 40)[0], 0.1) == {"left of"}
    assert box_relations(boxes(0, 0, 40, 40)[0], boxes(30, 0, 70, 40)[0], 0.3) == set()  # 30 - 24 = 6 px: 0.2
    assert box_relations(boxes(0, 0, 40, 40)[0], boxes(15, 0, 55, 40)[0], 0.1) == set()  # 7 / 15 < 1/2
    assert box_relations(boxes(0, 0, 40, 40)[0], boxes(2, 2, 42, 42)[0], 0.1) == set()  # within the margins


def test_duplicates_are_dropped_by_score_and_overlap():
    found = boxes(0, 0, 10, 10, 1, 1, 11, 11, 50, 50, 60, 60)
    kept = without_duplicates(found, torch.tensor([0.5, 0.9, 0.6]), iou_above=0.5, most=16)
    torch.testing.assert_close(kept, boxes(1, 1, 11, 11, 50, 50, 60, 60))
    assert len(without_duplicates(found, torch.tensor([0.5, 0.9, 0.6]), iou_above=0.99, most=2)) == 2
    assert without_duplicates(boxes(), torch.zeros(0), 0.5, 16).shape == (0, 4)


def test_a_box_around_a_group_of_others_is_dropped():
    """'two dogs': two dog boxes and one around both (IoU 0.5 with each, under NMS's 0.5) count two; a box around
    one other (a dog beside its own head) or around two that stick out of it stays."""
    pair = boxes(0, 0, 10, 10, 10, 0, 20, 10)
    torch.testing.assert_close(without_groups(torch.cat([boxes(0, 0, 20, 10), pair])), pair)
    torch.testing.assert_close(without_groups(torch.cat([boxes(-1, -1, 19, 11), pair])), pair)  # 90% inside
    nested = boxes(0, 0, 20, 20, 2, 2, 8, 8)
    torch.testing.assert_close(without_groups(nested), nested)
    spilling = torch.cat([boxes(0, 0, 20, 10), boxes(0, 0, 10, 10, 12, 0, 32, 10)])  # the second half outside
    torch.testing.assert_close(without_groups(spilling), spilling)
    assert without_groups(boxes()).shape == (0, 4)


@pytest.mark.parametrize("prompt, found, colours, score", [
    ("a photo of two dogs", {"dog": 2}, {}, 1.0),
    ("a photo of two dogs", {"dog": 3}, {}, 0.0),               # two or more: exactly as many
    ("a photo of two dogs", {"dog": 1}, {}, 0.0),
    ("a photo of a dog", {"dog": 3}, {}, 1.0),                  # "a": one or more
    ("a photo of a dog", {"dog": 0}, {}, 0.0),
    ("a photo of a red car and a blue bowl", {"car": 1, "bowl": 0}, {"car": 1}, 0.5),  # car, red; no bowl
    ("a photo of a red car and a blue bowl", {"car": 2, "bowl": 1}, {"car": 1, "bowl": 0}, 0.75),
    ("three white chairs", {"chair": 3}, {"chair": 2}, 0.5),    # a colour: at least the count of them
    ("a cup and a dog on a table", {"cup": 1, "dog": 1}, {}, 1.0),
])
def test_the_score_is_the_fraction_of_checks_met(prompt, found, colours, score, monkeypatch):
    reward = geneval()
    monkeypatch.setattr(reward, "coloured", lambda picture, found_boxes, noun, colour: colours.get(noun, 0))
    planted = {noun: boxes(*[[10 * k, 0, 10 * k + 8, 8] for k in range(n)]) for noun, n in found.items()}
    assert reward.score(read_prompt(prompt), planted, Image.new("RGB", (64, 64))) == score


def test_strict_scores_one_only_when_every_check_is_met():
    strict, picture = geneval(strict=True), Image.new("RGB", (64, 64))
    requirements = read_prompt("a photo of two dogs and a cat")
    assert strict.score(requirements, {"dog": boxes(0, 0, 8, 8, 20, 0, 28, 8), "cat": boxes(40, 0, 48, 8)},
                        picture) == 1.0
    assert strict.score(requirements, {"dog": boxes(0, 0, 8, 8), "cat": boxes(40, 0, 48, 8)}, picture) == 0.0
    assert geneval().score(requirements, {"dog": boxes(0, 0, 8, 8), "cat": boxes(40, 0, 48, 8)}, picture) == 0.5


def test_a_relation_is_met_by_some_pair_of_boxes():
    reward, picture = geneval(), Image.new("RGB", (100, 100))
    requirements = read_prompt("a photo of a cat left of a dog")
    cat, dog = boxes(0, 40, 20, 60), boxes(60, 40, 80, 60)
    assert reward.score(requirements, {"cat": cat, "dog": dog}, picture) == 1.0
    assert reward.score(requirements, {"cat": dog, "dog": cat}, picture) == pytest.approx(2 / 3)
    assert reward.score(requirements, {"cat": torch.cat([dog, cat]), "dog": dog}, picture) == 1.0
    assert reward.score(requirements, {"cat": boxes(), "dog": dog}, picture) == pytest.approx(1 / 3)


def test_a_colour_is_read_from_each_boxs_own_pixels(monkeypatch):
    """CLIP's reading stood in for by one-hot embeddings: a crop's of its mean colour (red or blue), a text's of the
    colour it names; a box is counted when the argmax is the asked colour."""
    from jagg_core.object_prompts import COLOURS
    from jagg_core.rewards import geneval as module

    def image_embeds(clip, crops, fit):
        means = [torch.tensor(crop.resize((1, 1), Image.Resampling.BOX).getpixel((0, 0)), dtype=torch.float32)
                 for crop in crops]
        return torch.nn.functional.one_hot(torch.tensor([COLOURS.index("red" if m[0] > m[2] else "blue")
                                                         for m in means]), len(COLOURS)).float()

    def text_embeds(clip, texts):
        return torch.nn.functional.one_hot(torch.tensor([COLOURS.index(t.split()[-2]) for t in texts]),
                                           len(COLOURS)).float()

    monkeypatch.setattr(module, "clip_image_embeds", image_embeds)
    monkeypatch.setattr(module, "clip_text_embeds", text_embeds)
    reward = geneval()
    reward.__dict__["colour_clip"] = None  # never loaded: the stand-ins above read the pixels
    picture = Image.new("RGB", (64, 64), (0, 0, 255))
    picture.paste((255, 0, 0), (0, 0, 32, 64))  # the left half red
    found = boxes(0, 0, 30, 64, 34, 0, 64, 64, 2, 2, 16, 16)
    assert [reward.coloured(picture, found, "car", colour) for colour in ("red", "blue", "green")] == [2, 1, 0]
    assert reward.coloured(picture, boxes(), "car", "red") == 0


def test_a_box_is_cut_as_whole_pixels_inside_the_picture():
    picture = Image.new("RGB", (40, 30))
    assert pixel_box(torch.tensor([-3.0, 2.4, 10.6, 50.0]), picture) == (0, 2, 11, 30)
    assert pixel_box(torch.tensor([39.5, 29.9, 39.6, 29.9]), picture) == (39, 29, 40, 30)  # at least one pixel


# --- the detector's path --------------------------------------------------------------------------------------------

def detector_boxes(folder, picture, noun, threshold, iou):
    """The boxes the detector finds of ``noun`` alone in ``picture`` (a batch of one), duplicates dropped."""
    from transformers import AutoModelForZeroShotObjectDetection, AutoProcessor
    model = AutoModelForZeroShotObjectDetection.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    encoded = processor(images=[picture], text=[[noun]], return_tensors="pt")
    with torch.no_grad():
        result = processor.post_process_grounded_object_detection(
            model(**encoded), encoded["input_ids"], threshold=threshold, text_threshold=0.0,
            target_sizes=[(picture.height, picture.width)])[0]  # the text's ids given: the model's outputs hold them
    return without_duplicates(result["boxes"], result["scores"], iou, 16)


def test_the_score_is_the_checks_on_what_the_detector_finds_of_each_object_alone(tiny_detector, tiny_clip):
    """Queries of several pictures and objects, batched three at a time, find what the detector finds of that object
    alone in that picture; the score is the checks on those boxes, the colours CLIP's reading of them."""
    from jagg_core.images import to_pil
    clip_folder, _ = tiny_clip
    torch.manual_seed(0)
    images = torch.rand(3, 3, 48, 64)
    pictures = to_pil(images)
    prompts = ["a photo of a red car and a blue bowl", "a photo of two dogs", "a photo of a cat left of a dog"]
    nouns = [[item.noun for item in read_prompt(prompt).objects] for prompt in prompts]
    options = dict(model_id=tiny_detector, colour_model_id=clip_folder, threshold=0.2, batch_size=3)
    reward = geneval(**options)
    found = reward.detect(pictures, nouns)
    alone = [{noun: detector_boxes(tiny_detector, picture, noun, 0.2, 0.5) for noun in names}
             for picture, names in zip(pictures, nouns)]
    assert [list(boxes) for boxes in found] == [["car", "bowl"], ["dog"], ["cat", "dog"]]
    for mine, theirs in zip(found, alone):
        for noun in mine:
            torch.testing.assert_close(mine[noun], theirs[noun])
    assert sum(len(boxes) for row in found for boxes in row.values()) >= 6
    assert not torch.equal(found[1]["dog"], found[2]["dog"])  # the pictures' own boxes
    scores = reward(images, prompts)
    expected = [reward.score(read_prompt(prompt), boxes, picture)
                for prompt, boxes, picture in zip(prompts, alone, pictures)]
    torch.testing.assert_close(scores, torch.tensor(expected))
    assert scores.dtype == torch.float32 and ((scores >= 0) & (scores <= 1)).all()
    torch.testing.assert_close(geneval(**{**options, "batch_size": 1})(images, prompts), scores)


def test_a_model_that_is_not_a_detector_is_one_line(tiny_clip):
    folder, _ = tiny_clip
    with pytest.raises(UserError, match=r"is not a zero-shot object detector .* such as IDEA-Research/grounding-dino"):
        geneval(model_id=folder)(torch.rand(1, 3, 32, 32), ["a photo of a dog"])


def test_the_plan_counts_the_detector_and_the_colour_clip(tiny_detector):
    from jagg_core.rewards.model_size import safetensors_params, scoring_model_size
    assert scoring_model_size("geneval", {}).params == 600e6
    tiny = safetensors_params(Path(tiny_detector))
    assert scoring_model_size("geneval", {"model_id": tiny_detector}).params == tiny + 428e6


def test_a_run_rewarded_by_geneval_trains(tiny_detector, tiny_clip, tmp_path):
    """The tiny model on the compositional prompts, rewarded by the tiny detector: the rollouts are scored and the
    run finishes."""
    clip_folder, _ = tiny_clip
    reward = f"rewards=[{{name: geneval, options: {{model_id: {tiny_detector}, colour_model_id: {clip_folder}, " \
             "threshold: 0.3}}]"
    result = run_cli("--preset", "tiny-sd3", "--set", reward, "--set", "prompts.source=compositional",
                     "--set", "train.iterations=1", "--set", "grpo.prompts_per_iteration=2",
                     "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = RunDirectory(tmp_path / "run").read_metrics()
    assert [row["iteration"] for row in rows] == [0, 1]
    assert all(0.0 <= row["eval/reward_mean"] <= 1.0 for row in rows)


def test_the_page_starts_the_preset_with_a_partial_reward_and_a_strict_judge(tmp_path):
    from app.form import build_config, preset_form
    form = preset_form("sd35-medium-geneval")
    assert form.rewards == ["geneval"] and form.knobs["eval.judges"] == ["geneval", "aesthetic"]
    config = build_config(form, tmp_path)
    assert [(spec.name, spec.options) for spec in config.rewards] == [("geneval", {})]
    assert [(spec.name, spec.options) for spec in config.eval.judges] == [("geneval", {"strict": True}),
                                                                          ("aesthetic", {})]
