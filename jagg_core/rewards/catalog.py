"""The reward catalog: every reward's name, its options (a typed schema) and where it is implemented.

This module imports no deep-learning library, so a config's rewards are checked (names, option names
and types) in milliseconds: by ``--dry-run``, by the app before Start and by :func:`build_reward`.
The implementation module of a reward is imported only when the reward is built.

To add a reward: write a :class:`~jagg_core.rewards.base.Reward` subclass in a module of this
package, and add one :class:`RewardEntry` (and an options model if it takes options) below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import UserError, require_packages

CLIP_L14 = "openai/clip-vit-large-patch14"
PICKSCORE = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
#: VQAScore's default model: the smallest Qwen2.5-VL chat model (3.75 B parameters, 7.5 GB in bfloat16)
VQA_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
#: VQAScore's question (Lin et al. 2024)
VQA_QUESTION = 'Does this figure show "{prompt}"? Please answer yes or no.'
#: its question for an image-editing row, shown the input image then the output
VQA_EDIT_QUESTION = ('The second image is meant to be the first image edited as instructed: "{prompt}". Does the '
                     'second image follow the instruction? Please answer yes or no.')
#: GenEval's detector here: an open-vocabulary one (172 M parameters)
GENEVAL_DETECTOR = "IDEA-Research/grounding-dino-tiny"
AESTHETIC_HEAD = "camenduru/improved-aesthetic-predictor/sac+logos+ava1-l14-linearMSE.pth"
#: the shapes world's caption grammar (torch-free): the shapes reward and judge read nothing else
SHAPES_GRAMMAR = "shapes_world:read_captions"
#: the objects, counts, colours and relations a compositional prompt names (torch-free): what the geneval reward checks
OBJECT_GRAMMAR = "object_prompts:read_prompts"


class RewardOptions(BaseModel):
    """A reward's ``options``: unknown names and wrong types are refused; numbers must be finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class NoOptions(RewardOptions):
    """The reward takes no options."""


class SquareInputOptions(RewardOptions):
    fit: Literal["pad", "crop"] = Field(
        "pad", description="how a wide or tall sample meets the model's square input: pad = the whole sample, centred "
        "on a square of the model's mean colour; crop = the model's own centre crop (its sides are not scored, so "
        "nothing there is trained); a square sample is read whole either way")


class ClipOptions(SquareInputOptions):
    model_id: str = Field(CLIP_L14, description="CLIP model: a Hub id or a folder saved with save_pretrained")
    processor_id: str | None = Field(None, description="its processor; default: model_id's")


class ClipDirectionalOptions(ClipOptions):
    reference_text: str = Field("a photo", description="the neutral caption the instruction's text direction starts "
                                "from: E_txt(instruction) - E_txt(reference_text)")


class PickScoreOptions(ClipOptions):
    model_id: str = Field(PICKSCORE, description="the PickScore CLIP model: a Hub id or a local folder")
    processor_id: str | None = Field(PICKSCORE_PROCESSOR, description="its processor (CLIP-H/14's)")


class AestheticOptions(ClipOptions):
    head: str = Field(AESTHETIC_HEAD, description="the aesthetic MLP: a local .pth file or OWNER/REPO/FILENAME")


class HpsOptions(SquareInputOptions):
    version: Literal["v2.0", "v2.1"] = Field("v2.1", description="HPS checkpoint")


class ImageRewardOptions(SquareInputOptions):
    model: str = Field("ImageReward-v1.0", description="ImageReward checkpoint name")


class VqaOptions(RewardOptions):
    model_id: str = Field(VQA_MODEL, description="the chat vision-language model: a Hub id or a local folder (its "
                          "AutoModelForImageTextToText and AutoProcessor)")
    question: str = Field(VQA_QUESTION, description="what the model is asked about each image; {prompt} is the "
                          "image's prompt")
    edit_question: str = Field(VQA_EDIT_QUESTION, description="what it is asked about an image-editing row, shown "
                               "the input image then the output; {prompt} is the instruction")
    answer: str = Field("Yes", min_length=1, description="the reply whose first-token probability is the score (one "
                        "token of the model's tokenizer)")
    batch_size: int = Field(4, ge=1, le=256, description="images a forward pass of the model scores")

    @field_validator("question", "edit_question")
    @classmethod
    def _names_the_prompt(cls, question: str) -> str:
        try:
            asked = question.format(prompt="")
        except (KeyError, IndexError, ValueError):
            raise ValueError("may hold no braces but {prompt}") from None
        if asked == question:
            raise ValueError("must hold {prompt}, where each image's prompt goes")
        return question


class GenEvalOptions(RewardOptions):
    model_id: str = Field(GENEVAL_DETECTOR, description="the zero-shot object detector: a Hub id or a local folder "
                          "(its AutoModelForZeroShotObjectDetection and AutoProcessor)")
    colour_model_id: str = Field(CLIP_L14, description="the CLIP model that reads each found object's colour: a Hub "
                                 "id or a folder (the memory plan counts it as CLIP ViT-L/14)")
    threshold: float = Field(0.35, gt=0, lt=1, description="the detector's score above which a box is an object")
    nms_iou: float = Field(0.5, gt=0, le=1, description="a box overlapping a higher-scoring one of the same object "
                           "by more than this IoU is that one found twice, and dropped")
    max_objects: int = Field(16, ge=1, le=100, description="boxes kept of one object at most")
    position_margin: float = Field(0.1, ge=0, le=1, description="GenEval's margin of a relation: the centres' "
                                   "offset is shortened by it times the boxes' summed sizes before its direction "
                                   "is read")
    batch_size: int = Field(8, ge=1, le=256, description="(image, object) queries a forward pass of the detector")
    strict: bool = Field(False, description="score 1 when every check of the prompt is met, else 0 (GenEval's "
                         "accuracy, e.g. for a judge); off: the fraction of its checks met (Flow-GRPO's reward)")


class OcrOptions(RewardOptions):
    lang: str = Field("eng", pattern=r"^[A-Za-z_+]+$", description="Tesseract language(s), e.g. eng or eng+deu")


class HttpOptions(RewardOptions):
    url: str = Field(pattern=r"^https?://\S+$", description="the reward server's http:// or https:// address")
    timeout: float = Field(60.0, gt=0, description="seconds one scoring call may take in all, retries included")
    retries: int = Field(2, ge=0, le=20, description="retries after a connection error, time-out or HTTP 5xx")
    retry_delay: float = Field(1.0, ge=0, le=600, description="seconds before the first retry, doubled each time")


#: the dtype a scoring model loads in on the CPU (the judges under ``eval.judges_on_cpu``, any reward of a CPU run)
CPU_DTYPE = "float32"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class RewardEntry:
    """A reward: ``name`` in configs, ``implementation`` as ``module:Class`` in this package, its options."""

    name: str
    implementation: str
    #: what it scores, in a sentence (the config reference and ``--list-rewards``)
    about: str
    options: type[RewardOptions] = NoOptions
    #: millions of parameters of the default scoring model, held on a GPU in ``device_dtype`` and on the CPU in
    #: :data:`CPU_DTYPE` (memory plan)
    device_params_m: float = 0.0
    #: millions of parameters of a second model it loads beside ``options.model_id``'s (in ``device_params_m``),
    #: counted so whatever ``model_id`` is
    companion_params_m: float = 0.0
    #: (low, high): the scores a working base model's samples get (None: unbounded on that side); the first
    #: iteration's doctor checks the base eval against it
    expected_range: tuple[float | None, float | None] = (None, None)
    #: ``module:function`` of jagg_core that reads the prompts' grammar, called as ``function(prompts, reader)``
    #: before launch (it raises a :class:`UserError` naming ``reader``); None: the reward scores any prompt
    prompt_grammar: str | None = None
    #: the dtype its scoring model is loaded in on a GPU (the memory plan counts its parameters in it)
    device_dtype: Literal["float32", "bfloat16"] = "float32"
    #: packages its model needs beyond requirements.txt, refused before launch when missing
    requires: tuple[str, ...] = ()
    #: it scores whole videos (``Reward.takes_videos``): a run of single images is refused before launch
    videos_only: bool = False

    def dtype_on(self, device_type: str) -> str:
        """The dtype its scoring model loads in on a device of ``device_type``: ``device_dtype`` on a GPU,
        :data:`CPU_DTYPE` on the CPU."""
        return self.device_dtype if device_type == "cuda" else CPU_DTYPE

    def load_class(self):
        module, _, cls = self.implementation.partition(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), cls)

    def check_prompts(self, prompts: list[str], reader: str) -> None:
        """The reward can read every prompt (:attr:`prompt_grammar`); ``reader`` names it in the refusal."""
        if self.prompt_grammar is not None:
            module, _, function = self.prompt_grammar.partition(":")
            getattr(importlib.import_module(f"jagg_core.{module}"), function)(prompts, reader)


CATALOG: dict[str, RewardEntry] = {entry.name: entry for entry in [
    # shapes: a blank image scores 0.02, pure noise about 0.2
    RewardEntry("shapes", "shapes:ShapesReward",
                "the shapes world's prompt checked in the pixels, model-free: the shape's colour and kind, the "
                "background's colour and the position, each a soft class probability; their mean, in [0, 1]",
                expected_range=(0.3, 1.0), prompt_grammar=SHAPES_GRAMMAR),
    RewardEntry("shapes_fidelity", "shapes:ShapesFidelity",
                "a judge of the shapes world: whether the image still looks like its drawings (colour purity and "
                "the shape's size), in [0, 1]", expected_range=(0.3, 1.0), prompt_grammar=SHAPES_GRAMMAR),
    RewardEntry("jpeg_compressibility", "jpeg:JpegCompressibility",
                "minus the image's JPEG size in kB at quality 95 (DDPO's): simpler images score higher",
                expected_range=(None, 0.0)),
    RewardEntry("jpeg_incompressibility", "jpeg:JpegIncompressibility",
                "the image's JPEG size in kB at quality 95 (DDPO's): more detailed images score higher",
                expected_range=(0.0, None)),
    # CLIP cosines of an image with its own prompt: 0.15-0.40 when the image shows it
    RewardEntry("clip_score", "clip:ClipScore", "CLIP ViT-L/14's cosine of the image and its prompt, in [-1, 1]",
                ClipOptions, 428, expected_range=(0.1, 1.0)),
    RewardEntry("pickscore", "clip:PickScore",
                "PickScore_v1 (CLIP-H/14 tuned on human preferences, Kirstain et al. 2023): its scaled cosine of the "
                "image and its prompt, about 18-24", PickScoreOptions, 986, expected_range=(10.0, 35.0)),
    RewardEntry("aesthetic", "clip:Aesthetic",
                "the LAION improved aesthetic predictor (an MLP on CLIP ViT-L/14 image embeddings), about 1-10",
                AestheticOptions, 429, expected_range=(2.0, 9.0)),
    RewardEntry("hpsv2", "packaged:HPSv2",
                "Human Preference Score v2 (the hpsv2 package's CLIP-H/14 model) of the image and its prompt",
                HpsOptions, 986, expected_range=(0.1, 1.0)),
    RewardEntry("image_reward", "packaged:ImageReward",
                "ImageReward (the image-reward package's BLIP-based human preference model) of the image and its "
                "prompt", ImageRewardOptions, 447, expected_range=(-2.5, 2.5)),
    RewardEntry("ocr", "ocr:OcrReward",
                "Tesseract's reading of the text the prompt quotes: one minus the normalised edit distance, in "
                "[0, 1]", OcrOptions, expected_range=(0.0, 1.0)),
    RewardEntry("clip_directional", "clip:ClipDirectional",
                "image editing: whether the output changed from its input the way the instruction says (CLIP "
                "ViT-L/14 directional similarity), in [-1, 1]", ClipDirectionalOptions, 428,
                expected_range=(-1.0, 1.0)),
    RewardEntry("http", "remote:HttpReward",
                "your own reward server: it is sent the images (base64 PNG) and prompts, and answers a score each",
                HttpOptions),
    # Grounding DINO tiny and CLIP ViT-L/14; the fraction of a prompt's GenEval checks met: 0 for a blank image
    # (SD3.5-Medium's GenEval is 0.63 in Flow-GRPO's paper, where a prompt counts only when all its checks are met)
    RewardEntry("geneval", "geneval:GenEval",
                "GenEval's checks of the prompt (objects, counts, colours, positions) by an open-vocabulary detector "
                "and CLIP: the fraction met (strict: all or nothing)", GenEvalOptions, 172 + 428,
                expected_range=(0.1, 1.0), prompt_grammar=OBJECT_GRAMMAR, companion_params_m=428),
    # Qwen2.5-VL-3B in bfloat16; its Qwen2.5-VL processor has a video part, which needs torchvision
    RewardEntry("vqa_score", "vqa:VqaScore",
                "VQAScore: a vision-language model's probability of answering Yes to whether the image shows its "
                "prompt (an editing row: follows its instruction), in [0, 1]", VqaOptions, 3755,
                expected_range=(0.0, 1.0), device_dtype="bfloat16", requires=("torchvision",)),
    RewardEntry("temporal_consistency", "temporal:TemporalConsistency",
                "videos: the mean CLIP cosine of consecutive frames, 1 for a still video", ClipOptions, 428,
                expected_range=(0.5, 1.0), videos_only=True),
    RewardEntry("motion", "temporal:Motion",
                "videos, model-free: the mean absolute change of consecutive frames averaged down to 64 px, 0 for a "
                "still video", expected_range=(0.0, 1.0), videos_only=True),
]}


def available_rewards() -> list[str]:
    """The reward names, sorted."""
    return sorted(CATALOG)


def reward_entry(name: str) -> RewardEntry:
    if name not in CATALOG:
        raise UserError(f"unknown reward '{name}'; available: {', '.join(available_rewards())}")
    return CATALOG[name]


def reward_options(name: str, options: dict) -> RewardOptions:
    """The validated options of reward ``name``; any problem is a one-line :class:`UserError`."""
    schema = reward_entry(name).options
    unknown = sorted(set(options) - set(schema.model_fields))
    if unknown:
        raise UserError(f"unknown option(s) {', '.join(unknown)} for reward '{name}'; "
                        f"allowed: {', '.join(schema.model_fields) or 'none'}")
    try:
        return schema.model_validate(options)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "missing":
            raise UserError(f"reward '{name}' needs options.{key}: {schema.model_fields[key].description}") from None
        raise UserError(f"bad value {first.get('input')!r} for options.{key} of reward '{name}': "
                        f"{first['msg']}") from None


def check_reward_specs(specs) -> None:
    """Every :class:`~jagg_core.config.RewardSpec` names a known reward with valid options."""
    for spec in specs:
        reward_options(spec.name, spec.options)


def videos_needed(name: str) -> str:
    """The line that refuses the video reward ``name`` a sample of fewer than 2 frames."""
    return (f"the {name} reward scores videos of 2 frames or more: use a video model (Wan) with "
            "sampling.num_frames >= 5")


def check_video_rewards(config) -> None:
    """A reward or judge that scores whole videos has them: ``sampling.num_frames`` of 2 or more (before launch,
    where the reward itself would refuse at the base eval, once the model has loaded)."""
    for spec in [*config.rewards, *config.eval.judges]:
        if reward_entry(spec.name).videos_only and config.sampling.num_frames < 2:
            raise UserError(videos_needed(spec.name))


def check_reward_packages(names: list[str]) -> None:
    """The rewards (or judges) ``names`` have the packages their models need (before a launch loads them)."""
    for name in names:
        require_packages(reward_entry(name).requires, f"the {name} reward")


def check_prompts_readable(config, train: list[str], held_out: list[str]) -> None:
    """The rewards can read every prompt and the judges every held-out one (they score the eval samples only):
    a reward with a prompt grammar refuses the first prompt it cannot read (:meth:`RewardEntry.check_prompts`)."""
    for spec in config.rewards:
        reward_entry(spec.name).check_prompts([*train, *held_out], f"the reward '{spec.name}'")
    for judge in config.eval.judges:
        reward_entry(judge.name).check_prompts(held_out, f"the judge '{judge.name}' (eval.judges)")
