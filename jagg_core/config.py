"""The run configuration: typed schema, presets, ``--set a.b=c`` overrides, one-line errors.

A run is described by one YAML document with the sections below. Presets live in
``presets/NAME.yaml``; ``load_config`` merges a preset or file with overrides and validates the
result. Every unknown key or bad value (non-finite numbers included) raises
:class:`~jagg_core.errors.UserError` naming the key and what is allowed.

Every key is described here, in its ``Field(description=...)``: :mod:`jagg_core.config_reference` renders
the schema as the config reference (docs/config.md), and the app's form shows the same descriptions as its help text.
:func:`yaml_value` and :func:`flat_keys` write a config's values and keys as ``--set KEY=VALUE`` reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from .errors import UserError
from .family_names import declared_families, declared_hub_ids, tiny_model_names
from .image_size import SIDE_MULTIPLE, SIDE_RANGE, ImageSize, parse_resolution
from .placement import branch_splits, trained_count

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
DEFAULT_PRESET = "shapes"
SEED_BOUND = 2 ** 63  # seeds are 64-bit: torch.Generator.manual_seed and the per-iteration seed mix need < 2**63
#: eval samples denoised together when ``sampling.rollout_chunk`` is not set
EVAL_CHUNK = 16
#: a video VAE (Wan) encodes the first frame alone, then each group of this many frames as one latent frame
VIDEO_FRAME_GROUP = 4
#: AWM's steps trained per sample by default (the paper's 6 of 14)
AWM_TRAIN_TIMESTEPS = 6


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def model_name_description() -> str:
    """``model.name``'s description, its lists of models as the families declare them (:mod:`.family_names`)."""
    return (f"base model: an in-memory test model ({', '.join(tiny_model_names())}), the embedded jagg-shapes, "
            f"a Hub id owner/name, a local diffusers pipeline folder ({', '.join(f.label for f in declared_families())}"
            f"), or random:ARCH[@LAYERS], a real architecture with random weights for benchmarks "
            f"(ARCH: {', '.join(declared_hub_ids())})")


def _one_way_to_write_a_size(value: object) -> int | str:
    """``512``, ``"512"`` and ``"512x512"`` are kept as ``512``; ``"832 X 480"`` as ``"832x480"``."""
    return parse_resolution(value).config_value()


#: a size setting (``sampling.resolution``, ``model.condition_resolution``), kept one way (:func:`parse_resolution`)
SizeSetting = Annotated[int | str, BeforeValidator(_one_way_to_write_a_size)]


class ModelConfig(_Section):
    """The base flow model, how it is loaded and how it is called (CFG, text length)."""

    name: str = Field("jagg-shapes", description=model_name_description())
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of model.name; "
                                 "null = the default branch")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the pipeline's weights are loaded in; the LoRA parameters stay float32")
    guidance_scale: float = Field(1.0, ge=0.0, description="classifier-free guidance g: v = v_neg + g (v_pos - v_neg) "
                                  "in rollouts, training and eval; 1 disables CFG (one forward instead of two)")
    guidance_scale_2: float | None = Field(None, ge=0.0, description="the CFG scale at a two-expert model's "
                                           "low-noise steps (Wan 2.2 A14B's transformer_2: the pipeline's "
                                           "guidance_scale_2; the official settings are 3.0 for text-to-video "
                                           "beside 4.0 at the high-noise steps; above 1 only beside a "
                                           "model.guidance_scale above 1, as the pipelines guide no step "
                                           "otherwise); null = model.guidance_scale")
    flow_shift: float | None = Field(None, gt=0.0, description="the schedule's shift s: sigma = s t / (1 + (s - 1) "
                                     "t) for t evenly spaced from 1 (the pipeline scheduler's shift, Wan's "
                                     "flow_shift), in rollouts, training and eval; larger s spends more steps at "
                                     "high noise (the official Wan 2.2 A14B settings: 12 for text-to-video, 5 for "
                                     "image-to-video; Wan 2.1: 5 at 720p); null = the base model's scheduler config; "
                                     "refused for models whose shift follows the resolution (FLUX.1, FLUX.2, "
                                     "Qwen-Image)")
    negative_prompt: str = Field("", description="negative prompt of CFG (used only when guidance_scale > 1)")
    flux_guidance: float = Field(3.5, ge=0.0, description="value of the FLUX guidance embedding (guidance-distilled "
                                 "models such as FLUX.1-dev); ignored by models without one")
    max_sequence_length: int = Field(77, ge=8, le=1024, description="prompt tokens given to the T5 / UMT5 / Qwen "
                                     "/ Mistral text encoder, a chat template's included (longer prompts are cut, and "
                                     "set-up says how many and the length that keeps them whole; Qwen-Image-Edit "
                                     "refuses them; FLUX allows at most 512)")
    expert: Literal["high_noise", "low_noise", "both"] = Field(
        "high_noise", description="which expert of a two-expert model (Wan 2.2 A14B) the LoRA trains: high_noise = "
        "the pipeline's transformer, which denoises from pure noise down to the boundary (sigma >= boundary_ratio), "
        "low_noise = its transformer_2, which finishes; the other expert samples with its base weights and only the "
        "trained expert's steps are trained; both = a LoRA in each, trained together at every step (two adapter "
        "files, the second loaded with load_into_transformer_2=True); models of one transformer take high_noise")
    quantize: Literal["none", "nf4", "int8"] = Field(
        "none", description="the frozen base transformer's weights: none = model.dtype; nf4 = 4-bit NormalFloat "
        "(bitsandbytes, bf16 compute, CUDA GPU only, QLoRA); int8 = 8-bit weight-only (torchao, per-channel scales, "
        "CPU or GPU); the LoRA and its optimizer stay float32")
    cache_text_embeddings: bool = Field(True, description="encode every training and eval prompt once at set-up "
                                        "(batched), keep the embeddings in host memory and in "
                                        "RUN/text_embeddings.safetensors (a resume reuses them without loading the "
                                        "encoders) and free the text encoders before training; a cache larger than "
                                        "the host's available memory or the run folder's free disk is refused "
                                        "before a download and at set-up (--plan shows its size); false: the "
                                        "encoders stay on the device and "
                                        "each iteration encodes its prompts, keeping only the eval prompts'")
    offload_text_encoders: bool = Field(False, description="the text encoders stay in host memory and each layer "
                                        "comes to the device as it runs (accelerate's cpu_offload): the encoding "
                                        "holds one layer's weights on the device instead of the encoders' (FLUX.2 "
                                        "[dev]'s Mistral Small: 1.3 GB instead of 48), the same embeddings, the "
                                        "encoding slower (every batch streams the weights over the bus); with "
                                        "model.cache_text_embeddings that is once, at set-up")
    vae_slicing: bool = Field(True, description="the VAE decodes one image (or video) at a time (diffusers "
                              "enable_slicing), each moved to host memory once decoded: the decode's peak memory "
                              "no longer grows with the batch")
    vae_tiling: bool = Field(False, description="the VAE decodes a large image or video in overlapping tiles "
                             "(diffusers enable_tiling): its decode takes a fraction of the memory (Wan 2.2 at "
                             "1280x704: about 1 GB instead of 10); the seams are blended, so the pixels differ "
                             "slightly from a whole decode's")
    condition_resolution: SizeSetting = Field(512, description="image-editing runs (FLUX.1 Kontext, Qwen-Image-Edit, "
                                            "FLUX.2 with model.input_images): the size of a prompt row's input "
                                            "images, a square's side (512) or WIDTHxHEIGHT (1024x768) as "
                                            "sampling.resolution; each is centre-cropped to its shape and resized "
                                            "to it before the model encodes it (the pipelines keep each input's own "
                                            "shape at about 1024 x 1024 pixels); Wan's image-to-video (Wan 2.1 "
                                            "I2V, Wan 2.2 TI2V-5B): sampling.resolution (the image is the first "
                                            "frame)")
    input_images: int | None = Field(None, ge=0, le=3, description="input images of each prompt row, every row "
                                     "the same, 'Picture 1' first: the image-editing models take 1 (unset) to their "
                                     "most (Qwen-Image-Edit-2509/2511: 3; FLUX.1 Kontext, Qwen-Image-Edit: 1); FLUX.2 "
                                     "[klein] and [dev] generate from text when unset or 0 and edit with 1-3 reference "
                                     "images; Wan 2.2 TI2V-5B generates video from text when unset or 0 and from a "
                                     "first frame with 1; Wan 2.1 I2V from a first frame (1, unset); other models read "
                                     "text alone")
    cudnn_attention: bool = Field(False, description="let torch choose cuDNN's attention kernel on a CUDA GPU; off: "
                                  "flash, memory-efficient or math attention. Off by default: it made "
                                  "FLUX.1-dev's backward fail on an H200 (cuDNN 9.19, torch 2.11; the GPU check's "
                                  "triage, README), where torch's other kernels ran it")
    bf16_reduced_precision_reduction: bool = Field(
        False, description="let cuBLAS reduce bf16 matmuls in bf16 (split-K; torch's default); off: in float32. Off "
        "by default: float32 sums are the more exact; the GPU check's triage cleared it of FLUX.1-dev's crash on an "
        "H200, and what turning it on gains is not measured")

    @property
    def condition_size(self) -> ImageSize:
        """``condition_resolution`` as ``(height, width)``."""
        return parse_resolution(self.condition_resolution)

    @property
    def uses_cfg(self) -> bool:
        """Whether any step is guided: ``guidance_scale > 1``, or ``guidance_scale_2 > 1`` (then the negative prompt
        is encoded, and a step whose scale is 1 takes the conditional velocity)."""
        return max(self.guidance_scale, self.guidance_scale_2 or 0.0) > 1.0

    @model_validator(mode="before")
    @classmethod
    def _legacy_quantize_4bit(cls, data):
        """Configs written before ``model.quantize`` said ``quantize_4bit: true|false``."""
        if isinstance(data, dict) and "quantize_4bit" in data and "quantize" not in data:
            data = dict(data)
            data["quantize"] = "nf4" if data.pop("quantize_4bit") else "none"
        return data


class LoraConfig(_Section):
    """The LoRA adapter trained on the transformer (peft), saved in diffusers format."""

    rank: int = Field(8, ge=1, le=512, description="LoRA rank r: each adapted linear layer W gets "
                      "W + (alpha / r) B A with A: in -> r, B: r -> out")
    alpha: float = Field(8.0, gt=0, description="LoRA alpha: the low-rank update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability on the input of the LoRA branch "
                           "(peft lora_dropout)")
    target_modules: list[str] | None = Field(None, description="module names to adapt; null = the family's attention "
                                             "projections (FLUX: also its feed-forward layers)")
    use_dora: bool = Field(False, description="DoRA (weight-decomposed LoRA, peft use_dora): each adapted layer's "
                           "weight becomes m (W + s B A) / ||W + s B A||, the norm per output row, with the magnitude "
                           "m trained beside A and B (m starts at ||W||, so the adapter starts as the base model); "
                           "costs that norm, a weight-sized temporary, in each layer's every call")
    use_rslora: bool = Field(False, description="rank-stabilized LoRA (peft use_rslora): the scale s is "
                             "alpha / sqrt(rank) in place of alpha / rank, so a higher rank does not shrink the update")
    init_lora: str | None = Field(None, description="start from this diffusers LoRA (Hub repo or local folder); "
                                  "it must match rank, target_modules and use_dora")


class SamplingConfig(_Section):
    """Rollouts (the Flow-GRPO SDE sampler, which gives each step a log-probability) and eval samples (Euler ODE)."""

    resolution: SizeSetting = Field(64, description="size of the images (or video frames) in pixels: the side of a "
                                  "square (512) or WIDTHxHEIGHT (832x480, Wan 2.1's own; 1024x576 landscape); each "
                                  f"side a multiple of {SIDE_MULTIPLE}, {SIDE_RANGE[0]} to {SIDE_RANGE[1]}")
    num_steps: int = Field(10, ge=2, le=200, description="denoising steps T of each rollout, on the family's sigma "
                           "schedule from noise (sigma 1) to image (sigma 0)")
    eval_num_steps: int | None = Field(None, ge=2, le=200, description="Euler ODE steps of the fixed-seed eval "
                                       "samples; null = sampling.num_steps")
    rollout_chunk: int | None = Field(None, ge=1, description="samples denoised together in a rollout or eval "
                                      "(chunks of the batch, the same samples and noise as one batch; written "
                                      "rollout_batch_size before); null = the whole rollout batch at once, eval "
                                      f"{EVAL_CHUNK} at a time")
    noise_level: float = Field(0.7, gt=0.0, le=2.0, description="SDE noise level a: step i from sigma s to s' adds "
                               "Gaussian noise of std a sqrt(s / (1 - s)) sqrt(s - s') (flow_grpo; see "
                               "sampling.sde_type)")
    sde_type: Literal["flow_grpo", "dance_grpo", "cps"] = Field(
        "flow_grpo", description="the stochastic step of GRPO's rollouts (jagg_core/sde.py has the formulas): "
        "flow_grpo = Flow-GRPO's SDE step, noise std a sqrt(s / (1 - s)) sqrt(s - s'); dance_grpo = DanceGRPO's, "
        "the same step with noise std a sqrt(s - s'); cps = Flow-CPS's coefficients-preserving step, noise std "
        "s' sin(a pi / 2), whose samples keep no extra noise (a in (0, 1]; its last step adds none, so it is not "
        "trained) and whose log-probability is the reference code's -mean (z' - mean)^2")
    num_frames: int = Field(1, ge=1, le=257, description="frames of each sample of a video model (Wan): 4k + 1, "
                            "e.g. 33 or 81 (its VAE makes one latent frame of 4); 1 = one image, the only value an "
                            "image model takes")
    fps: int = Field(16, ge=1, le=120, description="frames per second of the MP4s a video model's samples are "
                     "written as")
    reward_frames: int = Field(4, ge=1, description="frames of a video, evenly spaced from the first to the last, that "
                               "each image reward scores; the video's score is their mean (all frames when the video "
                               "has fewer; temporal_consistency reads every frame)")

    @model_validator(mode="before")
    @classmethod
    def _legacy_rollout_batch_size(cls, data):
        """Configs written before ``sampling.rollout_chunk`` said ``rollout_batch_size``."""
        if isinstance(data, dict) and "rollout_batch_size" in data and "rollout_chunk" not in data:
            data = dict(data)
            data["rollout_chunk"] = data.pop("rollout_batch_size")
        return data

    def chunk(self, samples: int) -> int:
        """Samples denoised together in a rollout batch of ``samples``."""
        return min(samples, self.rollout_chunk or samples)

    def eval_chunk(self, prompts: int) -> int:
        """Samples denoised together in an eval of ``prompts`` held-out prompts."""
        return min(prompts, self.rollout_chunk or EVAL_CHUNK)

    @property
    def size(self) -> ImageSize:
        """``resolution`` as ``(height, width)``."""
        return parse_resolution(self.resolution)

    @model_validator(mode="after")
    def _frames_of_a_video(self):
        if (self.num_frames - 1) % VIDEO_FRAME_GROUP:
            raise ValueError(f"num_frames must be 4k + 1 (1, 5, 9, ..., 81), got {self.num_frames}")
        return self


class GrpoConfig(_Section):
    """GRPO: groups of samples per prompt, group-normalized advantages, the per-step policy loss and its KL term
    (the groups and their advantages, num_generations to global_std, also serve nft and awm)."""

    num_generations: int = Field(4, ge=2, description="group size G: images sampled per prompt; each image's "
                                 "advantage is relative to its group")
    prompts_per_iteration: int = Field(2, ge=1, description="training prompts drawn per iteration (and per process); "
                                       "a rollout batch holds prompts_per_iteration x num_generations images")
    clip_range: float = Field(1e-4, gt=0.0, description="PPO ratio clip eps: the ratio exp(logp - logp_old) is "
                              "clipped to [1 - eps, 1 + eps]")
    policy_loss: Literal["clip", "guard", "dppo"] = Field(
        "clip", description="the policy loss of a step (jagg_core/grpo.py has the formulas): clip = PPO's ratio clip "
        "(Flow-GRPO); guard = GRPO-Guard's: the ratio normalized to centre on 1 at every step (RatioNorm), clipped, "
        "and each step's loss weighted 1 / (num_steps |dt|); dppo = DPPO's trust region: no clip, and a sample's step "
        "is dropped when its KL to the rollout's step exceeds grpo.kl_mask_threshold and its update widens the gap. "
        "The first optimizer step on a rollout batch is on-policy, where nothing is clipped or dropped: clip and dppo "
        "differ from the second on (grpo.inner_epochs >= 2). A per-task choice: on the default task guard gains 1.2x "
        "the clip's held-out reward per minute (2.3x with 9 of its 10 steps trained), but 0.8x and 0.9x on JPEG "
        "incompressibility and compressibility, and less than the clip with tree rollouts (README, The policy loss)")
    kl_mask_threshold: float = Field(1e-6, gt=0.0, description="policy_loss dppo: the per-step KL to the rollout's "
                                     "step, mean_k (mean_theta - mean_old)^2 / (2 std^2) over the latent's elements, "
                                     "from which a gap-widening sample is dropped (Flow-Factory's default; on the "
                                     "default task 22% of a second optimizer step's sample steps reach it)")
    adv_clip: float = Field(5.0, gt=0.0, description="advantages (r - mean_group) / (std + 1e-4) are clamped to "
                            "[-adv_clip, adv_clip]")
    group_by: Literal["draw", "prompt"] = Field("draw", description="the group an advantage is relative to: draw = "
                                                "the num_generations samples of one prompt draw; prompt = every "
                                                "sample of the process's rollout batch with the same prompt text "
                                                "(Flow-GRPO's per-prompt statistics, there over all processes)")
    global_std: bool = Field(False, description="divide the advantages by the standard deviation of the process's "
                             "whole rollout batch instead of the group's (Flow-GRPO's global_std, there over all "
                             "processes)")
    multi_reward: Literal["sum", "per_reward"] = Field(
        "sum", description="how several rewards make one advantage: sum = the advantage of their weighted sum "
        "(Flow-GRPO's), where the reward of the widest spread leads (PickScore is 100 times a CLIP cosine, "
        "clip_score a cosine); "
        "per_reward = each reward's own advantage, their mean weighted by the rewards' weights (DanceGRPO's), so a "
        "reward weighs what its weight says whatever its scale (jagg_core/grpo.py)")
    kl_beta: float = Field(0.0, ge=0.0, description="weight of the KL to the base model (adapter disabled) in the "
                           "form grpo.kl_form; 0 = off (no reference forwards)")
    kl_reference: Literal["rollout", "train"] = Field(
        "train", description="where the KL's reference velocities (adapter disabled) are computed: rollout = a second "
        "forward at every noisy rollout step; train = in the training pass, one no-grad forward per backward pass "
        "step, interpolated at a JAGG window's interior steps like the cached velocities (no reference forward in "
        "the rollout)")
    kl_form: Literal["step", "flow_grpo"] = Field(
        "step", description="the per-step KL, mean over the latent's elements: step = the Gaussian KL of the step, "
        "(mean_theta - mean_ref)^2 / (2 std_t^2 |dt|); flow_grpo = Flow-GRPO's, (mean_theta - mean_ref)^2 / "
        "(2 std_t^2), |dt| times smaller (15-100x on 10-40 steps), so Flow-GRPO's kl_beta goes with this form")
    timestep_fraction: float = Field(1.0, gt=0.0, le=1.0, description="fraction of the rollout steps trained: "
                                     "T = ceil(num_steps x fraction) steps (Flow-GRPO floors; under sampling.sde_type "
                                     "cps, of the num_steps - 1 steps that add noise), placed by "
                                     "grpo.window_placement")
    window_placement: Literal["range", "random"] = Field(
        "range", description="where the trained steps lie: range = the T consecutive steps from grpo.trained_start; "
        "random = each iteration, ceil(T / W) of the blocks of W = backward.window steps that cut the schedule "
        "([0, W-1], [W, 2W-1], ...), drawn from (train.seed, iteration), the same on every process and on a resume "
        "(DanceGRPO)")
    trained_start: int = Field(0, ge=0, description="first trained step of the range placement (0 = from the noise "
                               "end); trained_start + T must not exceed sampling.num_steps (cps: num_steps - 1)")
    slide_every: int = Field(0, ge=0, description="range placement only: the range moves one step later every "
                             "slide_every iterations, from trained_start until it reaches the last step, then stays "
                             "(MixGRPO's sliding window); 0 = fixed")
    shared_prefix: bool = Field(False, description="the num_generations samples of a prompt draw share their initial "
                                "noise, and the ODE steps before the first noisy step (grpo.ode_after_trained with "
                                "trained steps after step 0) are computed once per prompt draw, then branched")
    branch_factor: int = Field(0, ge=0, description="tree rollouts (BranchGRPO): 0 = off; b >= 2 = the "
                               "num_generations samples of a prompt draw start from one noise and split b ways at k "
                               "of the trained steps, spread evenly over them (first and last included), where "
                               "b^k = num_generations; paths share their steps before a split, whose velocities "
                               "(rollout and training pass) are computed once per node of the tree")
    ode_after_trained: bool = Field(False, description="rollouts take the ODE step at every step that is not trained "
                                    "(before and after a range, between random blocks), so only trained steps inject "
                                    "noise (Flow-GRPO-Fast, MixGRPO)")
    inner_epochs: int = Field(1, ge=1, description="optimizer steps on each rollout batch; the first is on-policy, "
                              "the later ones reuse the rollout's log-probs as logp_old")


class BackwardConfig(_Section):
    """How the LoRA gradient of the trained steps is computed: the exact per-step backward, or JAGG windows."""

    mode: Literal["exact", "jagg"] = Field("jagg", description="exact: one transformer backward per trained step "
                                           "(Flow-GRPO); jagg: the per-step gradients of each window are aggregated "
                                           "at its two endpoints")
    window: int = Field(5, ge=1, description="W consecutive trained steps per JAGG window; a window costs 2 backward "
                        "passes instead of W, W <= 2 is exact")
    velocities: Literal["cached", "forward"] = Field(
        "cached", description="velocities of a window's intermediate steps: cached = the rollout's with a first-order "
        "endpoint correction (no extra forward), forward = a no-grad forward per intermediate step")
    frac: float = Field(1.0, ge=0.0, le=1.0, description="fraction of the windows with interior steps, highest "
                        "linearity score first, that use JAGG; the rest take the exact backward (a window of at most "
                        "2 steps is exact either way and not counted)")
    min_fidelity: float | None = Field(None, ge=-1.0, le=1.0, description="windows whose routing score "
                                       "(backward.route_by) is below this take the exact backward, after "
                                       "backward.frac; null = no threshold")
    route_by: Literal["audit", "linearity"] = Field(
        "audit", description="the score that routes windows (backward.frac, backward.min_fidelity): audit = the "
        "window's gradient cosine in the latest fidelity audit, which then measures every window under JAGG (a window "
        "not audited yet scores 1: JAGG until the first audit; needs backward.audit_every > 0 to route); linearity = "
        "the mean cosine between the rollout's intermediate velocities and their interpolation from the endpoints, "
        "fresh every iteration but a weaker predictor (README: Where JAGG is exact)")
    joint: bool = Field(True, description="run the JAGG backward's transformer passes two at a time as one stacked "
                        "batch: faster, about 2x the peak memory; false = one at a time, the exact backward's peak")
    shared_knots: bool = Field(False, description="adjacent windows share an endpoint, so K windows cost K+1 passes "
                               "instead of 2K")
    audit_every: int = Field(10, ge=0, description="fidelity audit every N iterations: before the update, the exact "
                             "per-step gradient of backward.audit_samples samples of the rollout batch is computed "
                             "beside their JAGG gradient, only measured (the update and the next iterations are bit "
                             "for bit those of an unaudited run), and jagg/grad_cosine, jagg/grad_rel_err, "
                             "jagg/window_cosines and time/audit_s go to metrics.jsonl; 0 = off; nothing to audit "
                             "when no step is interpolated (mode exact, W <= 2, frac 0)")
    audit_samples: int = Field(8, ge=1, description="samples of each process's rollout batch that the audit "
                               "backpropagates, evenly spread over it (all of it when fewer), in micro-batches no "
                               "larger than the training's; an audit costs T + 2 K passes (K interpolated "
                               "windows) on these samples")


class NftConfig(_Section):
    """DiffusionNFT (train.algorithm nft): forward-process RL with implicit positive and negative policies
    (jagg_core/algorithms/nft.py has the loss)."""

    beta: float = Field(1.0, gt=0.0, description="beta: mixes the implicit policies, v+ = beta v + (1 - beta) v_old and "
                        "v- = (1 + beta) v_old - beta v, and divides the loss")
    kl_beta: float = Field(1e-4, ge=0.0, description="weight of the velocity's mean squared distance to the base "
                           "model's (adapter disabled); 0 = off (no reference forwards)")
    timestep_fraction: float = Field(0.99, gt=0.0, le=1.0, description="each sample is trained at int(num_steps x "
                                     "fraction) of the schedule's steps, a random permutation's first, fresh noise "
                                     "each")
    updates_per_rollout: int = Field(1, ge=1, description="optimizer steps on each rollout batch (the reference "
                                     "code's gradient_step_per_epoch): each sample's steps are cut in this many parts "
                                     "in their drawn order, and optimizer step s trains every sample at its part s; at "
                                     "most the steps per sample")
    old_decay_rate: float = Field(0.001, ge=0.0, description="the sampling (old) policy trails the trained one: after "
                                  "optimizer step k, old = d old + (1 - d) theta with d = min(old_decay_max, "
                                  "old_decay_rate x max(0, k - old_decay_delay)), updated once per iteration")
    old_decay_max: float = Field(0.5, ge=0.0, lt=1.0, description="the largest decay d of the old policy's update")
    old_decay_delay: int = Field(0, ge=0, description="optimizer steps before the old policy starts to trail (d = 0, "
                                 "it copies the trained weights)")


class AwmConfig(_Section):
    """Advantage Weighted Matching (train.algorithm awm): the flow-matching loss of the rollout's samples weighted by
    their advantages (jagg_core/algorithms/awm.py has the loss)."""

    train_timesteps: int | None = Field(None, ge=1, description="schedule steps K each sample is trained at, drawn "
                                        "stratified from steps 1..int(num_steps x awm.timestep_fraction), fresh noise "
                                        f"each; null: {AWM_TRAIN_TIMESTEPS} (the paper's), or all of those steps when "
                                        "there are fewer")
    timestep_fraction: float = Field(0.9, gt=0.0, le=1.0, description="the trained steps lie in 1..int(num_steps x "
                                     "fraction)")
    weighting: Literal["ghuber", "uniform"] = Field(
        "ghuber", description="the per-sample loss of the squared velocity error e: ghuber = the sigma-weighted "
        "generalized Huber ((e + 1e-10)^p - 1e-10^p) sigma / p; uniform = e")
    ghuber_power: float = Field(0.25, gt=0.0, le=1.0, description="the power p of the generalized Huber weighting")
    advantage_max: float = Field(1.0, gt=0.0, description="advantages clamped to +-grpo.adv_clip are rescaled to "
                                 "+-advantage_max")
    kl_beta: float = Field(1e-3, ge=0.0, description="weight of the velocity's mean squared distance to the base "
                           "model's (adapter disabled); 0 = off")
    ema_kl_beta: float = Field(1.0, ge=0.0, description="weight of the velocity's mean squared distance to a "
                               "lagging EMA of the LoRA; 0 = off")
    ema_kl_decay_rate: float = Field(0.001, ge=0.0, description="after iteration k, ema = d ema + (1 - d) theta with "
                                     "d = min(ema_kl_decay_max, ema_kl_decay_rate x k)")
    ema_kl_decay_max: float = Field(0.3, ge=0.0, lt=1.0, description="the largest decay d of the EMA regularizer")

    def trainable_steps(self, num_steps: int) -> int:
        """The schedule steps AWM draws from, ``1 .. n`` with ``n = int(T timestep_fraction)`` (``T = num_steps``)."""
        return int(num_steps * self.timestep_fraction)

    def steps_per_sample(self, num_steps: int) -> int:
        """K: ``train_timesteps``, by default ``min(AWM_TRAIN_TIMESTEPS, n)``: the paper's 6, or each of the ``n``
        :meth:`trainable_steps` when there are fewer (FLUX.2 klein's 4-step schedule has 3)."""
        return self.train_timesteps or min(AWM_TRAIN_TIMESTEPS, self.trainable_steps(num_steps))


class RewardSpec(_Section):
    """One term of the reward: an image's reward is the weighted sum r = sum_k w_k r_k over the list ``rewards``."""

    name: str = Field(description="registered reward name, e.g. shapes, jpeg_compressibility, aesthetic, "
                      "pickscore, hpsv2, ocr, http (every one, with its options: the rewards and their options, "
                      "below; --list-rewards)")
    weight: float = Field(1.0, description="weight w_k of this reward in the sum r = sum_k w_k r_k")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the reward (e.g. url for "
                                    "http, model_id for the CLIP-based ones: each reward's, below); unknown options "
                                    "are refused")


def term_names(names: list[str]) -> list[str]:
    """The names of reward terms (or judges) in the metrics: a name used a second time is ``NAME_2``, then
    ``NAME_3`` ..."""
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return labels


class JudgeSpec(_Section):
    """A judge: a reward that scores the fixed-seed eval samples only, never the training rollouts."""

    name: str = Field(description="registered reward name, e.g. shapes_fidelity, aesthetic, hpsv2, clip_score; not "
                      "a training reward with the same options")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the reward, as in rewards")


class EvalConfig(_Section):
    """What the fixed-seed eval measures beyond the training rewards: judges, the best adapter, the reward-hacking
    alarm (jagg_core/judges.py)."""

    judges: list[JudgeSpec] = Field(default_factory=list, description="rewards that score the eval samples only: "
                                    "each judge's mean is a curve (eval/judge/NAME), a row of the model card and "
                                    "what the hacking alarm watches; [] = none")
    judges_on_cpu: bool = Field(False, description="true: the judges' models run on the CPU, off the GPU (each CLIP "
                                "judge's 1.7 GB freed on a 16/24 GB card, held in float32 in each process's RAM, which "
                                "must have room), and the eval takes longer; the training is the same; false: on the "
                                "training device")
    best_by: str = Field("reward", description="the eval metric that picks the best adapter kept in RUN/best (higher "
                         "is better): reward = the training rewards' eval mean, or a judge's name (NAME_2 for a "
                         "judge named twice)")
    hacking_window: int = Field(2, ge=1, description="the alarm compares each eval with the one this many evals "
                                "before it: it fires when over those evals the training reward's eval mean rose at "
                                "every eval and in all by more than eval.hacking_z standard errors, while a judge's "
                                "fell at every eval and in all by more than hacking_z standard errors (standard "
                                "errors of the mean per-sample change: the same fixed-seed samples)")
    hacking_z: float = Field(2.0, gt=0.0, description="the alarm's noise allowance, in standard errors of the mean "
                             "per-sample change over the window")


class PromptsConfig(_Section):
    """The prompt set and its split into training prompts and held-out eval prompts."""

    source: str = Field("shapes", description="built-in set name, a .txt/.csv/.jsonl file, or hf://DATASET[:COLUMN]; "
                        "for image-editing models an image folder with prompts.csv/prompts.jsonl (file, prompt) or "
                        "hf://DATASET:TEXT_COLUMN,IMAGE_COLUMN")
    eval_count: int = Field(8, ge=1, description="distinct prompts held out from training for the fixed-seed eval "
                            "samples")
    split_seed: int = Field(0, ge=0, lt=SEED_BOUND, description="seed of the random choice of the held-out eval "
                            "prompts among the distinct prompts")
    eval_source: str | None = Field(None, description="the eval prompts themselves, a prompt set as source is "
                                    "(taken out of training; eval_count and split_seed then unused); null: "
                                    "eval_count prompts held out from source")
    limit: int | None = Field(None, ge=1, description="train on at most this many distinct prompts of source, drawn "
                              "with split_seed after the eval prompts are held out (a large dataset's subset, a "
                              "smaller text-embedding cache); null: all of them")


class TrainConfig(_Section):
    """The algorithm, the optimizer, precision and memory options, seeds, and how often to sample and checkpoint."""

    algorithm: Literal["grpo", "nft", "awm"] = Field(
        "grpo", description="grpo = GRPO on SDE rollouts with the exact or JAGG backward (backward, most of grpo); "
        "nft = DiffusionNFT and awm = Advantage Weighted Matching, forward-process losses on ODE rollouts (the nft, "
        "awm sections); all use the grpo section's groups (num_generations, prompts_per_iteration, adv_clip, "
        "group_by, global_std)")

    iterations: int = Field(10, ge=1, description="GRPO iterations, each a rollout batch, its rewards and "
                            "grpo.inner_epochs optimizer steps")
    learning_rate: float = Field(1e-4, gt=0, description="AdamW learning rate of the LoRA parameters: "
                                 "the peak of train.lr_scheduler's schedule")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW decoupled weight decay")
    optimizer: Literal["adamw", "adamw8bit"] = Field("adamw", description="adamw = torch AdamW; adamw8bit = "
                                                     "bitsandbytes 8-bit AdamW (CUDA GPU only)")
    max_grad_norm: float = Field(1.0, gt=0, description="the LoRA gradient's global L2 norm is clipped to this "
                                 "before each step; a non-finite norm skips the step")
    gradient_accumulation_steps: int = Field(1, ge=1, description="micro-batches the rollout batch is split into for "
                                             "the backward (less memory, same gradient, one optimizer step)")
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        "no", description="accelerate autocast of the transformer forwards; the SDE steps, log-probs and loss stay "
        "float32")
    gradient_checkpointing: bool = Field(False, description="recompute the transformer's activations in the backward: "
                                         "less memory, about one more forward per backward pass")
    seed: int = Field(0, ge=0, lt=SEED_BOUND, description="seed of the LoRA initialization and of each iteration's "
                      "prompts and noise, drawn from (seed, iteration, process) so a resume repeats them")
    sample_every: int = Field(5, ge=1, description="iterations between fixed-seed eval samples (also at the last "
                              "iteration; a run shorter than twice this samples every quarter of its length)")
    checkpoint_every: int = Field(5, ge=1, description="iterations between checkpoints of the LoRA and optimizer "
                                  "state (also at the last iteration and on a stop; a run shorter than twice this "
                                  "checkpoints every quarter of its length)")
    keep_checkpoints: int = Field(3, ge=1, description="newest checkpoints kept on disk; older ones are deleted")
    eval_seed: int = Field(1234, ge=0, lt=SEED_BOUND, description="seed of the eval samples' initial noise, the same "
                           "at every eval so the samples compare across iterations")
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts"] = Field(
        "constant", description="learning-rate schedule over the run's optimizer steps (iterations x "
        "grpo.inner_epochs), diffusers' get_scheduler; checkpointed with the optimizer")
    lr_warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0 to learning_rate at "
                                 "the start of the schedule (ignored by constant)")
    lr_num_cycles: int = Field(1, ge=1, description="hard restarts of cosine_with_restarts")
    ema_decay: float = Field(0.0, ge=0.0, lt=1.0, description="exponential moving average of the LoRA weights "
                             "(diffusers EMAModel, its decay ramping up as (1+n)/(10+n) to this value); the eval "
                             "samples and the saved adapter use the average; 0 = off")
    on_hacking: Literal["warn", "stop"] = Field(
        "warn", description="when the reward-hacking alarm fires (eval.hacking_window): warn = say so in the log, the "
        "status, the page and the model card; stop = also end the run as a stop does (checkpoint kept, resumable)")
    doctor: bool = Field(True, description="check the first iteration (rewards vary within groups, the on-policy "
                         "ratio is 1, the gradient is finite and moves the velocity, the base eval's reward is in "
                         "range, the JAGG audit agrees, no prompt is longer than model.max_sequence_length, each of "
                         "several rewards moves the advantage) and write the checklist to the log, the status, the "
                         "page and RUN/doctor.json; --doctor runs only that")
    report_to: list[Literal["tensorboard", "trackio", "wandb"]] = Field(
        default_factory=list, description="experiment trackers (accelerate) that get every metric and the eval "
        "sample grids; their files go under RUN/tracking (tensorboard --logdir RUN/tracking)")

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value):
        """YAML 1.1 reads a bare ``no`` (``mixed_precision: no``, ``--set train.mixed_precision=no``) as false."""
        return "no" if value is False else value


class HubConfig(_Section):
    """Publish the adapter and its model card to the Hugging Face Hub when the run finishes."""

    push: bool = Field(False, description="push the adapter and model card to hub.repo_id at the end of the run "
                       "(token: HF_TOKEN or hf auth login)")
    repo_id: str | None = Field(None, description="Hub model repo owner/name to push to, created if missing; "
                                "required when push is true")
    private: bool = Field(False, description="create the repo private (an existing repo keeps its visibility)")


class RunConfig(_Section):
    """A whole run: its name and directory, then one section per part of the training."""

    name: str = Field("run", description="run name; the default run directory is runs/NAME-TIMESTAMP")
    description: str = Field("", description="free text about the run; a preset's first line is listed by "
                             "--list-presets")
    output_dir: str | None = Field(None, description="run directory; null = runs/NAME-TIMESTAMP (--output-dir "
                                   "overrides it)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    backward: BackwardConfig = Field(default_factory=BackwardConfig)
    nft: NftConfig = Field(default_factory=NftConfig)
    awm: AwmConfig = Field(default_factory=AwmConfig)
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="shapes")])
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    hub: HubConfig = Field(default_factory=HubConfig)

    @model_validator(mode="after")
    def _consistent(self):
        if not self.rewards:
            raise ValueError("at least one reward is needed")
        if self.hub.push and not self.hub.repo_id:
            raise ValueError("hub.push is true but hub.repo_id is not set")
        routed = self.backward.frac < 1 or self.backward.min_fidelity is not None
        if self.backward.route_by == "audit" and routed and self.backward.audit_every == 0:
            raise ValueError("backward.route_by audit routes by the fidelity audit: set backward.audit_every > 0 "
                             "or route_by linearity")
        trainable = self.trainable_steps()
        count = trained_count(trainable, self.grpo.timestep_fraction)
        if self.sampling.sde_type == "cps" and self.sampling.noise_level > 1:
            raise ValueError(f"sampling.noise_level {self.sampling.noise_level:g} with sampling.sde_type cps: its "
                             "noise s' sin(a pi / 2) is largest at a = 1; give a in (0, 1]")
        if self.grpo.policy_loss == "guard" and self.sampling.sde_type == "cps":
            raise ValueError("grpo.policy_loss guard weights each step by 1 / |dt|, which balances Flow-GRPO's and "
                             "DanceGRPO's steps (their mean moves with dt), not CPS's: set sampling.sde_type "
                             "flow_grpo or dance_grpo, or policy_loss clip or dppo")
        if self.grpo.policy_loss == "dppo" and self.grpo.inner_epochs == 1:
            raise ValueError("grpo.policy_loss dppo drops samples from the second optimizer step on a rollout batch "
                             "(the first is on-policy, where nothing moved): set grpo.inner_epochs 2 or more, or "
                             "policy_loss clip")
        if self.grpo.slide_every and self.grpo.window_placement != "range":
            raise ValueError("grpo.slide_every moves a range placement: set grpo.window_placement range or "
                             "slide_every 0")
        factor, group = self.grpo.branch_factor, self.grpo.num_generations
        if factor:
            try:
                branch_splits(range(count), group, factor)
            except ValueError:
                raise ValueError(f"grpo.branch_factor {factor} must split the group of grpo.num_generations {group} "
                                 f"in k splits with {factor}^k = {group} and k <= the {count} trained steps (e.g. "
                                 "branch_factor 2 with num_generations 4 or 8), or be 0 (off)") from None
        if self.grpo.window_placement == "range" and self.grpo.trained_start + count > trainable:
            steps = (f"the {trainable} steps of sampling.num_steps {self.sampling.num_steps} that add noise under "
                     "sampling.sde_type cps (its last adds none)" if trainable < self.sampling.num_steps
                     else f"sampling.num_steps {self.sampling.num_steps}")
            raise ValueError(f"grpo.trained_start {self.grpo.trained_start} + {count} trained steps exceeds {steps}")
        self._algorithm_consistent()
        scale, scale_2 = self.model.guidance_scale, self.model.guidance_scale_2
        if scale_2 is not None and scale <= 1.0 < scale_2:
            raise ValueError(f"model.guidance_scale_2 {scale_2} guides the low-noise steps alone, which diffusers' Wan "
                             f"pipelines cannot sample (they guide no step at guidance_scale {scale}), so no one "
                             "could sample the adapter as trained: set model.guidance_scale above 1 too (Wan 2.2's "
                             "own 4.0 beside 3.0), or unset model.guidance_scale_2")
        judges = term_names([judge.name for judge in self.eval.judges])
        if self.eval.best_by not in ("reward", *judges):
            raise ValueError(f"eval.best_by '{self.eval.best_by}' must be reward or one of the judges "
                             f"({', '.join(judges) or 'none in eval.judges'})")
        return self

    def _algorithm_consistent(self) -> None:
        """Keys of another algorithm than ``train.algorithm`` must keep their defaults (they would do nothing)."""
        algorithm = self.train.algorithm
        values, defaults = self.model_dump(mode="json"), default_values()
        for owner, keys in ALGORITHM_KEYS.items():
            for key in keys if owner != algorithm else ():
                changed = _changed_key(_at(values, key), _at(defaults, key), key)
                if changed:
                    raise ValueError(f"{changed} applies to train.algorithm {owner} only; remove it, or set "
                                     f"train.algorithm {owner}")
        if algorithm != "grpo" and self.model.uses_cfg:
            raise ValueError(f"train.algorithm {algorithm} trains without classifier-free guidance (as its paper); "
                             "set model.guidance_scale 1" + " and unset model.guidance_scale_2" * bool(
                                 self.model.guidance_scale_2))
        if algorithm == "nft":
            per_sample = self.nft_steps_per_sample()
            if self.nft.updates_per_rollout > per_sample:
                raise ValueError(f"nft.updates_per_rollout {self.nft.updates_per_rollout} must be at most the "
                                 f"{per_sample} steps each sample is trained at (int(sampling.num_steps x "
                                 "nft.timestep_fraction))")
        if algorithm == "awm":
            last = self.awm.trainable_steps(self.sampling.num_steps)
            if last < 1:
                raise ValueError(f"train.algorithm awm trains at steps 1..int(sampling.num_steps x "
                                 f"awm.timestep_fraction), none at {self.sampling.num_steps} steps and fraction "
                                 f"{self.awm.timestep_fraction}; raise sampling.num_steps or awm.timestep_fraction")
            if (self.awm.train_timesteps or 0) > last:
                raise ValueError(f"awm.train_timesteps {self.awm.train_timesteps} must be at most the {last} "
                                 "steps 1..int(sampling.num_steps x awm.timestep_fraction)")

    def trainable_steps(self) -> int:
        """The rollout steps GRPO can train, those that add noise: all ``sampling.num_steps``, but the last under
        ``sampling.sde_type`` cps (its noise ``s' sin(a pi / 2)`` is 0 at ``s' = 0``)."""
        return self.sampling.num_steps - (self.sampling.sde_type == "cps")

    def nft_steps_per_sample(self) -> int:
        """DiffusionNFT's K: the schedule steps each sample is trained at, ``max(1, int(T nft.timestep_fraction))``."""
        return max(1, int(self.sampling.num_steps * self.nft.timestep_fraction))

    def for_algorithm(self, algorithm: str, overrides: list[str] = ()) -> "RunConfig":
        """This config under ``algorithm``, with every other algorithm's keys (:data:`ALGORITHM_KEYS`) at their
        defaults, then the ``overrides`` (``section.key=value``)."""
        data = self.model_dump(mode="json")
        data.setdefault("train", {})["algorithm"] = algorithm
        reset_other_algorithms(data)
        for text in overrides:
            apply_override(data, *parse_override(text))
        return validate_config(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @classmethod
    def describe(cls, key: str) -> str:
        """The schema's description of the dotted config key ``key`` (``train.seed``, ``rewards.weight``)."""
        return schema_field(key).description or ""


#: the config keys (a section stands for all of its keys) that only one algorithm reads; every other key applies to
#: all of them
ALGORITHM_KEYS: dict[str, list[str]] = {
    "grpo": ["backward", "sampling.noise_level", "sampling.sde_type", "grpo.clip_range",
             "grpo.policy_loss", "grpo.kl_mask_threshold", "grpo.kl_beta", "grpo.kl_reference",
             "grpo.kl_form", "grpo.timestep_fraction", "grpo.window_placement", "grpo.trained_start",
             "grpo.slide_every", "grpo.shared_prefix", "grpo.branch_factor", "grpo.ode_after_trained",
             "grpo.inner_epochs"],
    "nft": ["nft"],
    "awm": ["awm"],
}


#: each algorithm's name on the page
ALGORITHM_LABELS = {"grpo": "GRPO + JAGG (default)", "nft": "DiffusionNFT (most reward per minute on the default task)",
                    "awm": "AWM"}


def key_owner(key: str) -> str | None:
    """The only algorithm that reads the config key ``key`` (:data:`ALGORITHM_KEYS`); None: all of them."""
    return next((owner for owner, keys in ALGORITHM_KEYS.items()
                 if any(key == k or key.startswith(k + ".") for k in keys)), None)


def default_values() -> dict:
    """Every key's default, as ``model_dump(mode="json")`` writes a config (unvalidated: no validator runs)."""
    return RunConfig.model_construct().model_dump(mode="json")


def _at(data: dict, key: str) -> Any:
    """The value of the dotted ``key`` in a dumped config (``""``: all of it)."""
    for part in filter(None, key.split(".")):
        data = data[part]
    return data


def reset_other_algorithms(data: dict) -> None:
    """Put the keys of every algorithm but ``data``'s ``train.algorithm`` (:data:`ALGORITHM_KEYS`) back at their
    defaults in the (possibly partial) config ``data``."""
    algorithm = (data.get("train") or {}).get("algorithm", "grpo")
    for owner, keys in ALGORITHM_KEYS.items():
        for key in keys if owner != algorithm else ():
            *sections, name = key.split(".")
            node = data
            for section in sections:
                node = node.setdefault(section, {})
            node[name] = _at(default_values(), key)


def _changed_key(value: Any, default: Any, key: str) -> str | None:
    """``key`` (or its first sub-key, for a section) with its value when ``value`` differs from ``default``."""
    if isinstance(value, dict):
        return next(filter(None, (_changed_key(value[k], default[k], f"{key}.{k}") for k in value)), None)
    return f"{key} {value}" if value != default else None


def list_presets() -> dict[str, str]:
    """Preset name -> its one-line description."""
    presets = {}
    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        presets[path.stem] = str(data.get("description", "")).strip().splitlines()[0] if data.get("description") else ""
    return presets


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a UTF-8 text file; save the config as UTF-8 YAML") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a mapping of config sections, got {type(data).__name__}")
    return data


def preset_path(name: str) -> Path:
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown preset '{name}'; available: {', '.join(list_presets()) or 'none'}")
    return path


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], value); the value is parsed as YAML (numbers, booleans, lists)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"override '{text}' must look like section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_override(data: dict, keys: list[str], value: Any) -> None:
    """Set ``data[k1][k2]... = value`` after checking every key exists in the schema."""
    node = data
    for depth, key in enumerate(keys):
        path = ".".join(keys[: depth + 1])
        schema = _schema_at(keys[:depth], into_lists=False)
        if schema is None or key not in schema.model_fields:
            allowed = ", ".join(schema.model_fields) if schema else "none (not a section)"
            raise UserError(f"unknown config key '{path}'; allowed here: {allowed}")
        if depth == len(keys) - 1:
            node[key] = value
            return
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise UserError(f"config key '{path}' is not a section")


def _format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        parent = _schema_at(list(first["loc"])[:-1])
        allowed = ", ".join(parent.model_fields) if parent else ""
        return f"unknown config key '{where}'; allowed here: {allowed}"
    message = first["msg"]
    if first["type"] == "literal_error":
        return f"bad value {first.get('input')!r} for '{where}': {message}"
    value = first.get("input")
    shown = f" {value!r}" if value is not None and not isinstance(value, dict) else ""
    return f"bad value{shown} for '{where}': {message}"


def section_type(annotation: Any, into_lists: bool = True) -> type[BaseModel] | None:
    """The section model of a field: ``ModelConfig`` for ``model``, ``RewardSpec`` for ``rewards`` (a list of
    sections; None when not ``into_lists``); None for a value."""
    if get_origin(annotation) is list:
        if not into_lists:
            return None
        annotation = get_args(annotation)[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _schema_at(keys: list, into_lists: bool = True) -> type[BaseModel] | None:
    """The section model at the path ``keys`` of the schema (list indices skipped), the one walk of the schema;
    None where the path leaves it or ends at a value."""
    schema: type[BaseModel] | None = RunConfig
    for key in keys:
        if isinstance(key, int):
            continue
        if schema is None or key not in schema.model_fields:
            return None
        schema = section_type(schema.model_fields[key].annotation, into_lists)
    return schema


def validate_config(data: dict) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_validation_error(err)) from None


def load_config(preset: str | None = None, config_file: str | Path | None = None,
                overrides: list[str] = ()) -> RunConfig:
    """Resolve a run config: a preset (default ``DEFAULT_PRESET``) or a file, then overrides."""
    if preset and config_file:
        raise UserError("give either --preset or --config, not both")
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            problem = "is a folder, not a YAML file" if path.is_dir() else "does not exist"
            raise UserError(f"config file '{config_file}' {problem}")
        data = _read_yaml(path)
    else:
        data = _read_yaml(preset_path(preset or DEFAULT_PRESET))
    for text in overrides:
        apply_override(data, *parse_override(text))
    return validate_config(data)


def with_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """``config`` with the overrides (``section.key=value``) applied, validated again."""
    data = config.model_dump(mode="json")
    for text in overrides:
        apply_override(data, *parse_override(text))
    return validate_config(data)


def schema_field(key: str) -> FieldInfo:
    """The pydantic field of the dotted config key ``key``; list sections (``rewards``) are walked into."""
    *sections, name = key.split(".")
    schema = _schema_at(sections)
    if schema is None or name not in schema.model_fields:
        raise UserError(f"unknown config key '{key}'")
    return schema.model_fields[name]


def yaml_value(value: Any) -> str:
    """``value`` as it is written in a config file, on one line, as ``--set KEY=VALUE`` reads it back."""
    if isinstance(value, list):
        value = [item.model_dump(mode="json", exclude_defaults=True) if isinstance(item, BaseModel) else item
                 for item in value]
    if value == "":
        return '""'
    text = yaml.safe_dump(value, default_flow_style=True, width=10 ** 6).strip()
    return text.removesuffix("\n...").strip()


def flat_keys(data: dict, separator: str = ".") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (``separator`` between the keys; lists and empty mappings are
    leaves)."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update({f"{key}{separator}{inner}": leaf for inner, leaf in flat_keys(value, separator).items()})
        else:
            flat[key] = value
    return flat
