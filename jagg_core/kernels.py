"""Which kernels torch may choose: on a GPU, for a model's attention and its bf16 matmuls (``model.cudnn_attention``,
``model.bf16_reduced_precision_reduction``); on a CPU, that its math library gives the same bits on every call.

Both were the suspects of the FLUX.1-dev crash on an H200 (``CUBLAS_STATUS_EXECUTION_FAILED``, then an illegal
memory access; docs/gpu, issue #29): the cuDNN scaled-dot-product attention kernel on Hopper at sequence lengths
that are not a multiple of 128 (FLUX at 512 px: 1,024 latent patches + 77 text tokens = 1,101), and cuBLAS's
split-K kernels that reduce thin bf16 matmuls (a rank-4 LoRA's) in bf16. The GPU check's triage
(:mod:`jagg_core.gpu_check.triage`, 2026-12-04) named cuDNN attention: FLUX's path fails with it (cuDNN 9.19,
torch 2.11) and runs without it, whatever the bf16 reductions. Both stay on the safe side by default: attention
runs on the flash, memory-efficient or math kernels, and bf16 matmuls reduce in float32 (cleared of the crash, the
more exact sums; what bf16 reductions would gain is not measured). The switches are process-wide torch flags; a
CPU ignores them.

On a CPU, :func:`settle_cpu_math` runs as :func:`~jagg_core.models.load_flow_model` begins: before any model
is built, and in a run before the judges, which load after the base model.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


def apply_kernel_settings(config: ModelConfig) -> None:
    """Set torch's process-wide kernel switches from ``config``: cuDNN's SDPA kernel on or off
    (``torch.backends.cuda.enable_cudnn_sdp``) and bf16 GEMMs' reduced-precision reduction
    (``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``)."""
    torch.backends.cuda.enable_cudnn_sdp(config.cudnn_attention)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = config.bf16_reduced_precision_reduction


def settle_cpu_math() -> None:
    """Set up torch's CPU vector math library on one thread, so that every later call gives the same bits.

    With MKL (the x86 wheels), torch computes ``exp``, ``log``, ``sin``, ``cos``, ``tanh``, ``erf`` and the like of a
    contiguous tensor with MKL's vector math functions, split over the intra-op threads in chunks of 2,048 elements.
    MKL sets those functions up at their first call; when that call runs on several threads at once, one thread's
    chunks can come out at lower precision (measured: 11,904 of 24,576 float64 sines off by up to 7e-9), in about a
    third of processes. diffusers computes SD3's positional embedding with float64 ``sin`` and ``cos`` as the
    transformer is built, so a tiny or random-weight model, and the adapter trained on it, differed now and then
    between two runs of one seed. A call on 16 elements runs on one thread and sets the library up before anything
    else calls it; repeating it costs nothing."""
    torch.sin(torch.zeros(16, dtype=torch.float64))
