"""Build ``jagg-shapes``: a tiny, real SD3 text-to-image pipeline trained on coloured shapes.

    python -m jagg_core.tiny.build [--out jagg_core/assets/jagg-shapes] [--seed 0]

Stages, all on the CPU and deterministic given ``--seed``:

1. render jittered 32x32 drawings of the training captions (:mod:`jagg_core.tiny.dataset`), a
   share ``--wrong-position`` of them with the shape at another position than the caption says
   (caption noise: the model then follows the position word most of the time, not always, which
   leaves a verifiable gap for reward fine-tuning to close);
2. train a small ``AutoencoderKL`` (factor 4: 32x32x3 -> 8x8x4) to reconstruct them; set its
   ``shift_factor`` / ``scaling_factor`` from the latents' mean and std;
3. train two small ``CLIPTextModelWithProjection`` encoders (word-level tokenizer, no T5)
   jointly with a small ``SD3Transformer2DModel`` by rectified flow matching on the latents:
   ``x_s = (1 - s) x_0 + s noise``, target ``noise - x_0``, ``s`` logit-normal, timestep
   ``1000 s``, 10% empty captions (so classifier-free guidance works), a log-uniform number of
   zero "T5" tokens per batch (so any ``max_sequence_length`` works), EMA weights kept;
4. check that the collapsed-padding training equals the pipeline's 256-token padding, save the
   ``StableDiffusion3Pipeline`` (EMA weights), reload it to score its held-out eval reward
   (:mod:`jagg_core.tiny.evaluate`) and write ``build_info.json`` and ``README.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from diffusers.models.attention_processor import JointAttnProcessor2_0
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from ..rewards.shapes import ShapesReward
from . import PIPELINE_DIR
from .dataset import caption_split, render_dataset
from .evaluate import EVAL_SEED, EVAL_STEPS, evaluate
from .padded_attention import CollapsedPaddingAttnProcessor
from ..shapes_world import draw_array, parse_caption
from .tokenizer import build_tokenizer

IMAGE_SIZE = 32
TOKENS = 16  # CLIP context length (captions are at most 12 tokens with BOS/EOS)
T5_PADDING = 256  # zero tokens the SD3 pipeline appends without text_encoder_3 (its default)
PADDING_RANGE = (4, 512)  # training draws the zero-token count log-uniformly from this range
CAPTION_DROPOUT = 0.1
EMA_DECAY = 0.998


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------

def make_vae() -> AutoencoderKL:
    """Factor-4 VAE: 32x32x3 images <-> 8x8x4 latents (SD3 layout: no quant convs)."""
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=IMAGE_SIZE,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64), layers_per_block=1, norm_num_groups=8,
        mid_block_add_attention=False, use_quant_conv=False, use_post_quant_conv=False,
        scaling_factor=1.0, shift_factor=0.0,
    )


def make_text_encoder(vocab_size: int) -> CLIPTextModelWithProjection:
    """A 2-layer CLIP text encoder of width 32 with a 32-d projection (pooled output)."""
    config = CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=TOKENS, projection_dim=32,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    return CLIPTextModelWithProjection(config)


def make_transformer() -> SD3Transformer2DModel:
    """4 joint blocks of width 96 over the 8x8 latent (patch 1: 64 image tokens); the context is
    the two CLIP encoders' hidden states side by side (64-d), the pooled input their projections."""
    return SD3Transformer2DModel(
        sample_size=IMAGE_SIZE // 4, patch_size=1, in_channels=4, out_channels=4, num_layers=4,
        attention_head_dim=32, num_attention_heads=3, joint_attention_dim=64, caption_projection_dim=96,
        pooled_projection_dim=64, pos_embed_max_size=IMAGE_SIZE // 4,
    )


def encode_text(encoders, tokenizer, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_embeds [B, TOKENS, 64], pooled [B, 64])`` exactly as the SD3 pipeline builds them
    from the two CLIP encoders (penultimate hidden states, projected EOS), before T5 padding."""
    ids = tokenizer(captions, padding="max_length", max_length=TOKENS, truncation=True, return_tensors="pt").input_ids
    hidden, pooled = [], []
    for encoder in encoders:
        out = encoder(ids, output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled.append(out[0])
    return torch.cat(hidden, -1), torch.cat(pooled, -1)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

def train_vae(vae: AutoencoderKL, images: torch.Tensor, steps: int, batch: int, generator: torch.Generator) -> None:
    """Reconstruction (MSE + L1 in [-1, 1]) with a tiny KL term, AdamW with cosine decay."""
    optimizer = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)))
    vae.train()
    for step in range(steps):
        x = images[torch.randint(len(images), (batch,), generator=generator)] * 2 - 1
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = vae.decode(z).sample
        loss = F.mse_loss(recon, x) + 0.5 * (recon - x).abs().mean() + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step}/{steps} loss {loss.item():.4f}")
    vae.eval()


@torch.no_grad()
def reconstruction_reward(vae: AutoencoderKL, captions: list[str]) -> float:
    """Mean ``shapes`` reward of the VAE's reconstructions of canonical drawings of ``captions``."""
    images = torch.stack([torch.from_numpy(draw_array(parse_caption(c), size=IMAGE_SIZE)) for c in captions])
    recon = (vae.decode(vae.encode(images * 2 - 1).latent_dist.mean).sample + 1) / 2
    return ShapesReward()(recon.clamp(0, 1), captions).mean().item()


@torch.no_grad()
def encode_latents(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
    """The posterior means of ``images`` (unscaled), in batches."""
    return torch.cat([vae.encode(chunk * 2 - 1).latent_dist.mean for chunk in images.split(256)])


def train_flow(transformer, encoders, tokenizer, latents: torch.Tensor, captions: list[str], steps: int,
               batch: int, generator: torch.Generator) -> None:
    """Rectified flow matching of the transformer and both text encoders; leaves the EMA weights in them."""
    modules = torch.nn.ModuleList([transformer, *encoders])
    ema = copy.deepcopy(modules).requires_grad_(False)
    optimizer = torch.optim.AdamW(modules.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.99))
    warmup = 200
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min(1.0, (i + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / steps)))
    )
    padding = CollapsedPaddingAttnProcessor(T5_PADDING)
    transformer.set_attn_processor(padding)
    low, high = math.log(PADDING_RANGE[0]), math.log(PADDING_RANGE[1])
    modules.train()
    for step in range(steps):
        padding.set_copies(math.exp(low + (high - low) * torch.rand((), generator=generator).item()))
        index = torch.randint(len(latents), (batch,), generator=generator)
        x0 = latents[index]
        drop = torch.rand(batch, generator=generator) < CAPTION_DROPOUT
        text = ["" if d else captions[i] for d, i in zip(drop.tolist(), index.tolist())]
        embeds, pooled = encode_text(encoders, tokenizer, text)
        embeds = torch.cat([embeds, embeds.new_zeros(batch, 1, embeds.shape[-1])], 1)
        s = torch.sigmoid(torch.randn(batch, generator=generator))
        noise = torch.randn(x0.shape, generator=generator)
        xs = (1 - s[:, None, None, None]) * x0 + s[:, None, None, None] * noise
        v = transformer(hidden_states=xs, encoder_hidden_states=embeds, pooled_projections=pooled,
                        timestep=s * 1000).sample
        loss = F.mse_loss(v, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(modules.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            decay = min(EMA_DECAY, (1 + step) / (10 + step))
            for e, p in zip(ema.parameters(), modules.parameters()):
                e.lerp_(p, 1 - decay)
        if step % 100 == 0 or step == steps - 1:
            log(f"flow step {step}/{steps} loss {loss.item():.4f}")
    modules.load_state_dict(ema.state_dict())
    modules.eval()
    transformer.set_attn_processor(JointAttnProcessor2_0())


@torch.no_grad()
def check_collapsed_padding(transformer, encoders, tokenizer, latents: torch.Tensor, captions: list[str]) -> float:
    """Max difference between the pipeline's 256-zero-token context and the collapsed one."""
    embeds, pooled = encode_text(encoders, tokenizer, captions[:4])
    x, t = latents[:4], torch.tensor([900.0, 600.0, 300.0, 50.0])
    full = torch.cat([embeds, embeds.new_zeros(4, T5_PADDING, embeds.shape[-1])], 1)
    reference = transformer(hidden_states=x, encoder_hidden_states=full, pooled_projections=pooled, timestep=t).sample
    transformer.set_attn_processor(CollapsedPaddingAttnProcessor(T5_PADDING))
    one = torch.cat([embeds, embeds.new_zeros(4, 1, embeds.shape[-1])], 1)
    collapsed = transformer(hidden_states=x, encoder_hidden_states=one, pooled_projections=pooled, timestep=t).sample
    transformer.set_attn_processor(JointAttnProcessor2_0())
    return (reference - collapsed).abs().max().item()


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def build(out: Path, seed: int, vae_steps: int, flow_steps: int, copies: int, vae_batch: int, batch: int,
          wrong_position: float) -> None:
    """Train every component, then save, check and evaluate the pipeline folder ``out``."""
    started = time.time()
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator().manual_seed(seed)
    train_captions, held_out = caption_split()
    images, labels = render_dataset(train_captions, copies, IMAGE_SIZE, seed, wrong_position)
    log(f"dataset: {len(images)} images of {len(train_captions)} captions ({len(held_out)} held out)")

    tokenizer = build_tokenizer(max_length=TOKENS)
    vae = make_vae()
    encoders = [make_text_encoder(len(tokenizer)), make_text_encoder(len(tokenizer))]
    transformer = make_transformer()

    train_vae(vae, images, vae_steps, vae_batch, generator)
    raw = encode_latents(vae, images)
    shift, scale = raw.mean().item(), 1.0 / raw.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    latents = (raw - shift) * scale
    log(f"vae done ({time.time() - started:.0f}s): shift {shift:.4f} scale {scale:.4f}, "
        f"reconstruction reward on held-out drawings {reconstruction_reward(vae, held_out):.3f}")

    train_flow(transformer, encoders, tokenizer, latents, labels, flow_steps, batch, generator)
    log(f"flow done ({time.time() - started:.0f}s)")
    difference = check_collapsed_padding(transformer, encoders, tokenizer, latents, labels)
    log(f"collapsed vs 256-token padding: max |dv| = {difference:.2e}")
    if difference > 1e-3:
        raise RuntimeError(f"collapsed padding differs from the pipeline's by {difference}")

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=encoders[0], tokenizer=tokenizer, text_encoder_2=encoders[1], tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None,
    )
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    info = {
        "seed": seed, "vae_steps": vae_steps, "flow_steps": flow_steps, "copies": copies,
        "wrong_position": wrong_position, "vae_batch": vae_batch,
        "batch": batch, "threads": torch.get_num_threads(), "train_captions": len(train_captions),
        "held_out_captions": len(held_out), "build_seconds": round(time.time() - started), "torch": torch.__version__,
    }
    write_card(out, info)
    log(f"saved {out} in {info['build_seconds']}s")


def write_card(out: Path, info: dict) -> None:
    """Evaluate the folder (:func:`~jagg_core.tiny.evaluate.evaluate`), then write ``build_info.json``
    (build settings and the eval figures) and a short ``README.md`` into it."""
    info = {**info, "eval": {"prompts": "64 held-out captions", "sampler": "Euler ODE", "steps": EVAL_STEPS,
                             "guidance_scale": 1.0, "seed": EVAL_SEED,
                             **{k: round(v, 4) for k, v in evaluate(out).items()}}}
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    size_mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    (out / "README.md").write_text(CARD.format(reward=info["eval"]["reward"], steps=EVAL_STEPS, size=size_mb,
                                               seconds=info["build_seconds"], seed=info["seed"],
                                               vae_steps=info["vae_steps"], flow_steps=info["flow_steps"],
                                               wrong_position=info["wrong_position"]))
    log(f"eval: {info['eval']}; folder {size_mb:.1f} MB")


CARD = """# jagg-shapes

A tiny `StableDiffusion3Pipeline` (32x32 RGB) trained from scratch on procedurally drawn coloured
shapes, captioned "a {{colour}} {{shape}} on a {{colour}} background, {{position}}". Components: two
small CLIP text encoders over a word-level tokenizer (no T5: load with `text_encoder_3=None,
tokenizer_3=None`), an `AutoencoderKL` (8x8x4 latents), an `SD3Transformer2DModel` trained by
flow matching, `FlowMatchEulerDiscreteScheduler` (shift 1.0).

Built by `python -m jagg_core.tiny.build --seed {seed} --vae-steps {vae_steps} --flow-steps {flow_steps}
--wrong-position {wrong_position}` on the CPU in {seconds} s; {size:.1f} MB. A share {wrong_position} of the
training drawings put the shape at another position than their caption says (caption noise), so
the model follows the position word most of the time but not always. Settings and eval figures: `build_info.json`.
Mean `shapes` reward of Euler ODE samples ({steps} steps, no guidance) of the 64 held-out
captions: {reward:.3f} (`python -m jagg_core.tiny.evaluate`).
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jagg_core.tiny.build", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PIPELINE_DIR, help="pipeline folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae-steps", type=int, default=1200)
    parser.add_argument("--flow-steps", type=int, default=1600)
    parser.add_argument("--copies", type=int, default=24, help="jittered drawings per training caption")
    parser.add_argument("--wrong-position", type=float, default=0.15,
                        help="share of training drawings whose shape sits at another position than the caption's")
    parser.add_argument("--vae-batch", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64, help="flow-matching batch")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (results can differ by count)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    build(args.out, args.seed, args.vae_steps, args.flow_steps, args.copies, args.vae_batch, args.batch,
          args.wrong_position)


if __name__ == "__main__":
    main()
