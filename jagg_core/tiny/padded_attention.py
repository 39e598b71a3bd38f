"""Exact, cheap training of SD3 joint attention with the pipeline's zero "T5" padding.

Without a third text encoder, ``StableDiffusion3Pipeline`` appends ``max_sequence_length``
(256) all-zero tokens to the CLIP prompt embeddings. Those tokens stay identical to each other
through every block (same input, same per-token layers, same attention query), so they can be
represented by one token whose attention logit gets ``+log(256)``: softmax over 256 equal keys
is softmax over one key weighted 256 times. Training with this processor and one zero token
gives exactly the function the pipeline computes with 256, at a quarter of the tokens.

The build varies ``copies`` from batch to batch (:meth:`CollapsedPaddingAttnProcessor.set_copies`),
so that the model works with any ``max_sequence_length`` (JAGG's default is 77; 8 is cheapest).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention


class CollapsedPaddingAttnProcessor:
    """SD3 joint attention where the last context token stands for ``copies`` equal tokens."""

    def __init__(self, copies: int):
        self.set_copies(copies)

    def set_copies(self, copies: float) -> None:
        """Let the last context token stand for ``copies`` equal tokens from now on."""
        self.log_copies = math.log(copies)

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs):
        if attn.norm_q is not None or attn.norm_added_q is not None:
            raise NotImplementedError("CollapsedPaddingAttnProcessor does not support qk_norm")
        batch, n_image = hidden_states.shape[0], hidden_states.shape[1]
        heads = attn.heads

        def split_heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, -1, heads, x.shape[-1] // heads).transpose(1, 2)

        def project(image_proj, context_proj) -> torch.Tensor:
            return torch.cat([split_heads(image_proj(hidden_states)), split_heads(context_proj(encoder_hidden_states))], 2)

        query = project(attn.to_q, attn.add_q_proj)
        key = project(attn.to_k, attn.add_k_proj)
        value = project(attn.to_v, attn.add_v_proj)
        bias = torch.zeros(1, key.shape[2], dtype=query.dtype, device=query.device)
        bias[0, -1] = self.log_copies
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)
        out = out.transpose(1, 2).reshape(batch, -1, heads * query.shape[-1])
        image_out, context_out = out[:, :n_image], out[:, n_image:]
        image_out = attn.to_out[1](attn.to_out[0](image_out))
        if attn.context_pre_only:
            return image_out, context_out
        return image_out, attn.to_add_out(context_out)
