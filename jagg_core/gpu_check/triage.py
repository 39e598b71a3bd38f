"""The FLUX.1-dev crash, taken apart (issue #29): which of two suspects fails on this GPU.

The real-size FLUX bench (tiny-sd3's settings on ``random:flux-dev``: LoRA rank 4 on attention and feed-forward,
8 samples, 16 in a joint JAGG pass, 1,101 tokens a sample = 32 x 32 latent patches + 77 text tokens, head dim 128,
bf16) died on an H200 with ``CUBLAS_STATUS_EXECUTION_FAILED`` and then an illegal memory access, reported in a
LoRA linear. The suspects:

* the cuDNN SDPA attention kernel on Hopper at sequence lengths that are not a multiple of 128 (pytorch issues
  167101, 171532, 196678): the ``triage-sdpa-BACKEND-TOKENS`` cases run FLUX's attention alone (forward and
  backward) at 1,101 and at 1,152 = 9 x 128 tokens under each SDPA backend;
* cuBLAS split-K kernels on very thin bf16 matmuls such as a rank-4 LoRA's (pytorch issues 192061, 170676): the
  ``triage-lora-rankR`` cases run a LoRA's two matmuls alone (forward and backward, bf16 autocast, width 3072,
  16 x 1,101 rows) at rank 4 and 16;
* then the project's own FLUX path (:func:`jagg_core.bench.bench_train_phase`, the bench's exact and JAGG W = 5
  backward) at the real width and :data:`FLUX_PATH_LAYERS` blocks, as it crashed and without each suspect, each
  set by the product's keys ``model.cudnn_attention`` and ``model.bf16_reduced_precision_reduction``
  (:data:`FLUX_PATH_SETTINGS`), whose defaults turn both suspects off;
* on an H200 (2026-12-04) the path failed with cuDNN attention and ran without it, while the contiguous attention
  cases all passed: the ``triage-sdpa-cudnn-TOKENS-permuted`` cases run cuDNN attention alone on the layout
  diffusers hands to SDPA (permuted views of ``samples x tokens x heads x head_dim`` tensors), to tell whether that
  layout is the trigger.

Each case is a step of its own: its own process, ``CUDA_LAUNCH_BLOCKING=1`` (the error surfaces at the kernel that
made it), a 20 s cap (60 s for the FLUX path); an error from the kernel is its row and the next case starts with
a fresh CUDA context. The isolated cases run side by side, each in its own process and CUDA context; the FLUX path
runs alone.
A kernel the device lacks (cuDNN or flash attention on a CPU) is a ``skipped`` row. :func:`triage_verdict` reads
the rows and names the product fix they imply. ``--reduced`` runs the same cases at 1/16 of the tokens, width 64.
"""

from __future__ import annotations

import functools

from .common import NOT_OK, CheckOptions, Step, torch_device

#: SDPA backends by the name of their case (``torch.nn.attention.SDPBackend`` members)
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
#: the crashed length (32 x 32 latent patches + 77 text tokens) and the next multiple of 128
TRIAGE_TOKENS = (1101, 1152)
LORA_RANKS = (4, 16)
#: FLUX.1-dev's attention: 24 heads of 128 = width 3072; 16 samples = a joint JAGG pass of 8
FLUX_SHAPE = {"samples": 16, "heads": 24, "head_dim": 128}
#: ``--reduced``: 2 samples, 2 heads of 32 (width 64), tokens / 16
REDUCED_SHAPE = {"samples": 2, "heads": 2, "head_dim": 32}
REDUCED_TOKEN_DIVISOR = 16
#: largest relative error (max |error| / max |reference|) against float32 that bf16 is allowed: its rounding
#: (2^-8) over sums of ~1,000 to ~17,000 terms stays near 0.01; a broken kernel gives NaN or errors near 1
BF16_TOLERANCE = 0.1
#: 1 double- and 2 single-stream blocks: FLUX's real 1 : 2 proportion, the real width
FLUX_PATH_LAYERS = 3
#: the FLUX path's cases, each the product's two kernel keys (:mod:`jagg_core.kernels`): as it crashed
#: (torch's defaults, both suspects on) and without each suspect; both off is the product's default, which the
#: real-size ``bench-flux-dev`` runs
FLUX_PATH_SETTINGS = {
    "as-crashed": ("model.cudnn_attention=true", "model.bf16_reduced_precision_reduction=true"),
    "no-cudnn-sdpa": ("model.cudnn_attention=false", "model.bf16_reduced_precision_reduction=true"),
    "no-bf16-split-k": ("model.cudnn_attention=true", "model.bf16_reduced_precision_reduction=false"),
}
#: the suspect each FLUX path setting turns off: its name, the product's key, and its isolated cases
SUSPECTS = {
    "no-cudnn-sdpa": ("cuDNN SDPA attention", "model.cudnn_attention",
                      [f"sdpa-cudnn-{tokens}" for tokens in TRIAGE_TOKENS]),
    "no-bf16-split-k": ("cuBLAS bf16 split-K", "model.bf16_reduced_precision_reduction",
                        [f"lora-rank{rank}" for rank in LORA_RANKS]),
}
#: the cuDNN attention cases in diffusers' layout (:func:`attention_case` with ``permuted``)
PERMUTED_CASES = [f"sdpa-cudnn-{tokens}-permuted" for tokens in TRIAGE_TOKENS]
#: what torch raises when the chosen backend has no kernel for the inputs (a device that lacks it)
NO_KERNEL = ("No available kernel", "No viable backend")
#: an isolated kernel's case: a process start, torch and CUDA up (four processes at once), a kernel and its float32
#: reference; the 12 of them, four at a time, tell the suspects apart within 60 s (240 s one at a time)
ISOLATED_CAP_S = 20
#: an isolated case's GPU memory (its float32 reference at 16 x 24 x 1,152 x 128 is 0.23 GB a tensor): they share
#: the GPU; the FLUX path runs alone (its crash may come from the memory it takes)
ISOLATED_GB = 4
LAUNCH_BLOCKING = {"CUDA_LAUNCH_BLOCKING": "1"}


def triage_steps() -> list[Step]:
    """The triage's cases, the isolated kernels first (seconds each), then the FLUX path."""
    sdpa = [Step(f"triage-sdpa-{backend}-{tokens}", "triage", functools.partial(attention_case, backend, tokens),
                 cap_s=ISOLATED_CAP_S, reduced_cap_s=60, env=LAUNCH_BLOCKING, shares_gb=ISOLATED_GB)
            for tokens in TRIAGE_TOKENS for backend in SDPA_BACKENDS]
    sdpa += [Step(f"triage-sdpa-cudnn-{tokens}-permuted", "triage",
                  functools.partial(attention_case, "cudnn", tokens, permuted=True), cap_s=ISOLATED_CAP_S,
                  reduced_cap_s=60, env=LAUNCH_BLOCKING, shares_gb=ISOLATED_GB) for tokens in TRIAGE_TOKENS]
    lora = [Step(f"triage-lora-rank{rank}", "triage", functools.partial(lora_case, rank), cap_s=ISOLATED_CAP_S,
                 reduced_cap_s=60, env=LAUNCH_BLOCKING, shares_gb=ISOLATED_GB) for rank in LORA_RANKS]
    path = [Step(f"triage-flux-path-{setting}", "triage", functools.partial(flux_path_case, setting), cap_s=60,
                 reduced_cap_s=300, env=LAUNCH_BLOCKING) for setting in FLUX_PATH_SETTINGS]
    return [*sdpa, *lora, *path]


def _shape(options: CheckOptions, tokens: int) -> dict:
    shape = REDUCED_SHAPE if options.reduced else FLUX_SHAPE
    return {**shape, "tokens": tokens // REDUCED_TOKEN_DIVISOR if options.reduced else tokens}


def _relative_error(value, reference) -> float:
    """max |value - reference| / max |reference| (NaN where ``value`` is not finite)."""
    import torch
    if not torch.isfinite(value).all():
        return float("nan")
    return ((value.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-12)).item()


def _judge(row: dict, errors: dict[str, float], dtype) -> dict:
    """``row`` with ``errors``, failed where one is not finite or (bf16) above :data:`BF16_TOLERANCE`."""
    import torch
    tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else 1e-3
    row.update(errors)
    bad = [name for name, err in errors.items() if not err <= tolerance]  # NaN is bad too
    if bad:
        row.update(status="failed", reason=f"{', '.join(bad)} off the float32 reference (tolerance {tolerance})")
    return row


def attention_case(backend: str, tokens: int, options: CheckOptions, permuted: bool = False) -> list[dict]:
    """FLUX's attention alone (self-attention of ``samples x heads x tokens x head_dim``, forward and backward)
    under one SDPA backend, against the float32 MATH backend on the same inputs. ``permuted``: in the layout
    diffusers hands to SDPA (its native attention backend): query, key, value and the output's gradient are
    ``samples x tokens x heads x head_dim`` tensors seen through ``permute(0, 2, 1, 3)``, not contiguous; the
    cuDNN attention that failed in FLUX's path passed on contiguous tensors."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    device = torch_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = _shape(options, tokens)
    row = {"step": f"triage-sdpa-{backend}-{tokens}" + ("-permuted" if permuted else ""), "status": "ok",
           "backend": backend, "layout": "permuted" if permuted else "contiguous", "device_type": device.type,
           "dtype": str(dtype).removeprefix("torch."), **shape}
    generator = torch.Generator(device).manual_seed(0)
    size = (shape["samples"], shape["tokens"], shape["heads"], shape["head_dim"])
    inputs = [torch.randn(size, device=device, generator=generator) for _ in range(3)]
    grad_out = torch.randn(size, device=device, generator=generator)

    def heads_first(tensor):
        """samples x heads x tokens x head_dim: a view (diffusers' layout) or a contiguous copy."""
        view = tensor.permute(0, 2, 1, 3)
        return view if permuted else view.contiguous()

    def attention(kernel: str, tensors_dtype):
        leaves = [t.to(tensors_dtype).requires_grad_() for t in inputs]
        with sdpa_kernel(getattr(SDPBackend, kernel)):
            out = F.scaled_dot_product_attention(*(heads_first(leaf) for leaf in leaves))
            out.backward(heads_first(grad_out.to(tensors_dtype)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out.detach(), leaves[0].grad

    try:
        out, grad = attention(SDPA_BACKENDS[backend], dtype)
    except RuntimeError as err:
        if not any(message in str(err) for message in NO_KERNEL):
            raise  # a CUDA error: the step fails with it
        return [{**row, "status": "skipped", "reason": f"no {backend} kernel for these inputs on {device.type}"}]
    ref_out, ref_grad = attention("MATH", torch.float32)
    return [_judge(row, {"out_err": _relative_error(out, ref_out), "grad_err": _relative_error(grad, ref_grad)},
                   dtype)]


def lora_case(rank: int, options: CheckOptions) -> list[dict]:
    """A rank-``rank`` LoRA's matmuls alone, as in training: float32 factors under bf16 autocast on
    ``samples x tokens`` rows of FLUX's width, ``y = (x @ A^T) @ B^T``; the backward's ``x^T``-reductions over all
    rows into the thin gradients of A and B are what split-K kernels compute. Against float32 without autocast."""
    import torch
    device = torch_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = _shape(options, TRIAGE_TOKENS[0])
    width, rows = shape["heads"] * shape["head_dim"], shape["samples"] * shape["tokens"]
    row = {"step": f"triage-lora-rank{rank}", "status": "ok", "rank": rank, "width": width, "rows": rows,
           "device_type": device.type, "dtype": str(dtype).removeprefix("torch.")}
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(rows, width, device=device, generator=generator)
    down = torch.randn(rank, width, device=device, generator=generator) / width ** 0.5
    up = torch.randn(width, rank, device=device, generator=generator) / rank ** 0.5
    grad_out = torch.randn(rows, width, device=device, generator=generator)

    def lora(autocast: bool):
        a, b = down.clone().requires_grad_(), up.clone().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            y = (x.to(dtype) if autocast else x) @ a.T @ b.T
        y.backward(grad_out.to(y.dtype))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return y.detach(), a.grad, b.grad

    out, grad_down, grad_up = lora(autocast=dtype == torch.bfloat16)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_out, ref_down, ref_up = lora(autocast=False)
    errors = {"out_err": _relative_error(out, ref_out), "grad_down_err": _relative_error(grad_down, ref_down),
              "grad_up_err": _relative_error(grad_up, ref_up)}
    return [_judge(row, errors, dtype)]


def flux_path_case(setting: str, options: CheckOptions) -> list[dict]:
    """The project's FLUX path, as the crashed bench ran it (the real width, :data:`FLUX_PATH_LAYERS` blocks,
    512 px, bf16, gradient checkpointing, exact and JAGG W = 5 joint), with the kernel keys of ``setting``."""
    from .steps import bench_rows
    keys = FLUX_PATH_SETTINGS[setting]
    rows = bench_rows("flux-dev", options, layers=options.layers or FLUX_PATH_LAYERS, repeats=1, warmup=0,
                      overrides=keys)
    return [{**row, "step": f"triage-flux-path-{setting}", "setting": " ".join(keys)} for row in rows]


def triage_verdict(statuses: dict[str, str]) -> list[str]:
    """What the triage's last outcomes (step name -> status) say, and the product fix each outcome implies."""
    def failed(case):
        return statuses.get(f"triage-{case}") in NOT_OK

    def ok(case):
        return statuses.get(f"triage-{case}") == "ok"

    cases = [f"sdpa-{b}-{t}" for t in TRIAGE_TOKENS for b in SDPA_BACKENDS] + PERMUTED_CASES
    cases += [f"lora-rank{r}" for r in LORA_RANKS] + [f"flux-path-{s}" for s in FLUX_PATH_SETTINGS]
    if not any(ok(c) or failed(c) for c in cases):
        return ["The triage has not answered yet: not run, or its kernels are not on this device."]
    lines = []
    short, aligned = TRIAGE_TOKENS
    if failed(f"sdpa-cudnn-{short}"):
        where = "only at lengths not a multiple of 128" if ok(f"sdpa-cudnn-{aligned}") else "at both lengths"
        lines.append(f"cuDNN SDPA fails {where}: keep cuDNN attention out on this device (the product's "
                     "default model.cudnn_attention=false)"
                     + (", or pad sequences to a multiple of 128" if ok(f"sdpa-cudnn-{aligned}") else "") + ".")
    other_attention = [b for b in SDPA_BACKENDS if b != "cudnn" and any(failed(f"sdpa-{b}-{t}") for t in TRIAGE_TOKENS)]
    if other_attention:
        lines.append(f"SDPA backend(s) {', '.join(other_attention)} fail too: attention itself is broken on this "
                     "torch / driver; pin the MATH backend there and report upstream.")
    if failed("lora-rank4"):
        where = "at rank 4 only" if ok("lora-rank16") else "at ranks 4 and 16"
        lines.append(f"The LoRA's thin bf16 matmuls fail {where} (cuBLAS split-K): keep bf16 reductions in "
                     "float32 (the product's default model.bf16_reduced_precision_reduction=false), or run the LoRA "
                     "factors' matmuls in float32" + (", or raise the minimum rank to 16" if ok("lora-rank16") else "")
                     + ".")
    fixes = [s for s in FLUX_PATH_SETTINGS if s != "as-crashed" and ok(f"flux-path-{s}")]
    cleared = [s for s in FLUX_PATH_SETTINGS if s != "as-crashed" and failed(f"flux-path-{s}")]
    permuted_failed = [case for case in PERMUTED_CASES if failed(case)]
    if failed("flux-path-as-crashed") and len(fixes) == 1 and cleared:
        suspect, key, alone = SUSPECTS[fixes[0]]
        lines.append(f"The cause is {suspect}: the FLUX path fails as it crashed and with {cleared[0]}, and "
                     f"passes with {fixes[0]}; {key}=false stays the product's default, and "
                     f"{SUSPECTS[cleared[0]][0]} is cleared.")
        if all(ok(case) for case in alone) and not permuted_failed:
            lines.append(f"{suspect} alone ({', '.join(alone)}) passes at the crashed shapes: the failure needs the "
                         "model's own inputs, so the key stays off for every model rather than for some lengths.")
    elif failed("flux-path-as-crashed") and fixes:
        lines.append(f"The FLUX path fails as it crashed and passes with {' and with '.join(fixes)}: that "
                     "setting's key keeps its safe default (the product's defaults turn both suspects off).")
    elif failed("flux-path-as-crashed"):
        lines.append("The FLUX path fails under every setting run: neither suspect alone explains it; next "
                     "suspects: gradient checkpointing, RoPE, the joint pass's batch.")
    elif ok("flux-path-as-crashed"):
        lines.append("The FLUX path passes at reduced depth: the crash needs the real depth (memory, or a kernel "
                     "chosen for its shapes); the real-size bench-flux-dev decides.")
    if permuted_failed:
        lines.append(f"cuDNN attention fails on the layout diffusers hands to SDPA (permuted views; "
                     f"{', '.join(permuted_failed)})" + (", and passes on contiguous tensors of the same shapes: "
                     "the layout is the trigger" if all(ok(f"sdpa-cudnn-{t}") for t in TRIAGE_TOKENS) else "")
                     + "; a report for pytorch/cuDNN can be made from that case alone.")
    elif all(ok(case) for case in PERMUTED_CASES):
        lines.append("cuDNN attention passes on diffusers' permuted layout too: the trigger is elsewhere in the "
                     "model's path (next: gradient checkpointing's recompute, the joint pass's batch).")
    if statuses.get("bench-flux-dev") == "ok" and failed("flux-path-as-crashed"):
        lines.append("FLUX.1-dev at real size runs under the product's defaults (bench-flux-dev ok).")
    return lines or ["No case failed so far."]
