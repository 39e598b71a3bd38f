"""Which CUDA kernels torch may choose for a model's attention and its bf16 matmuls (``model.cudnn_attention``,
``model.bf16_reduced_precision_reduction``).

Both are the suspects of the FLUX.1-dev crash on an H200 (``CUBLAS_STATUS_EXECUTION_FAILED``, then an illegal
memory access; docs/gpu, issue #29): the cuDNN scaled-dot-product attention kernel on Hopper at sequence lengths
that are not a multiple of 128 (FLUX at 512 px: 1,024 latent patches + 77 text tokens = 1,101), and cuBLAS's
split-K kernels that reduce thin bf16 matmuls (a rank-4 LoRA's) in bf16. Until the GPU check's triage
(:mod:`jagg_core.gpu_check.triage`) has told them apart, both default to the safe side: attention runs on the flash,
memory-efficient or math kernels, and bf16 matmuls reduce in float32. The switches are process-wide torch flags; a
CPU ignores them.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig


def apply_kernel_settings(config: ModelConfig) -> None:
    """Set torch's process-wide kernel switches from ``config``: cuDNN's SDPA kernel on or off
    (``torch.backends.cuda.enable_cudnn_sdp``) and bf16 GEMMs' reduced-precision reduction
    (``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``)."""
    torch.backends.cuda.enable_cudnn_sdp(config.cudnn_attention)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = config.bf16_reduced_precision_reduction
