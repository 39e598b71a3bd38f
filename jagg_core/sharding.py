"""Sharding the frozen base transformer across processes: FSDP2 through accelerate.

``accelerate launch --config_file presets/accelerate/fsdp.yaml -m jagg_core.run ...`` (an accelerate
config with ``distributed_type: FSDP`` and ``fsdp_version: 2``) splits the transformer's frozen weights
over all processes, on one machine or several: torch's ``fully_shard`` through accelerate's
``fsdp2_prepare_model``, one FSDP unit per transformer block (the config's auto-wrap policy; the
blocks are the model's ``_no_split_modules``) and one for the rest. Each process keeps 1/N of the
weights and all-gathers one block's weights only for its forward and again for its backward, so a
transformer larger than one GPU trains.

The LoRA is left out of the sharding (FSDP2's ``ignored_params``, from accelerate's
``ignored_modules``): its parameters stay whole, float32 and on every process, are trained exactly as
without sharding (their gradients averaged across processes by the trainer before each step, as in
plain data parallelism) and stay identical everywhere; the adapter is saved, unsharded and in
diffusers format, from rank 0's copy, and checkpoints and EMA see plain tensors. The LoRA is small,
so sharding it would save little and would make every step, checkpoint and the saved adapter
depend on gathering it.

Every transformer call is then a collective that all processes must make together, the same number
of times in the same order. What the trainer does for that:

- the rollouts, the exact backward and the eval make the same calls everywhere by construction (the
  eval runs on every process; only rank 0 scores and writes it);
- the JAGG routing (``backward.frac < 1``) is decided on the windows' scores averaged over the
  processes (:meth:`Sharding.agree`, see :mod:`jagg_core.jagg`), and each plan's pass structure is
  compared across processes before it runs (:meth:`Sharding.check_same_plan`), so a mismatch is an
  error instead of a hang;
- every FSDP unit, the root included, reshards after each forward, so between transformer calls all
  processes are in the same state and rank 0 alone can save the adapter: ``state_dict()`` reshards a
  unit left whole, which would otherwise happen on rank 0 only and make its next forward all-gather
  what the other processes do not.

The text encoders, the VAE and the reward models are not sharded (each process has its own copy),
so what calls them may differ between processes. A quantized transformer (``model.quantize``) is
refused: its packed weights cannot be split by FSDP.

accelerate turns FSDP on only on accelerators; under ``accelerate launch`` on a CPU-only machine the
processes are plain gloo data parallel. There the same accelerate function shards the transformer
over the gloo processes (the launcher's ``FSDP_*`` settings, read by accelerate's
``FullyShardedDataParallelPlugin``), so the whole path runs, and is tested, on a CPU.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model

from .errors import UserError
from .jagg import BackwardPlan
from .models.base import FlowModel

#: peft's LoRA modules (``...to_q.lora_A``, ``...to_q.lora_A.default``; a DoRA's ``...to_q.lora_magnitude_vector``),
#: kept out of the sharding
LORA_MODULES = r".*\.lora_(A|B|magnitude_vector)(\..+)?"


def fsdp_requested() -> bool:
    """The process was started by ``accelerate launch`` with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_plugin(accelerator: Accelerator) -> FullyShardedDataParallelPlugin | None:
    """The FSDP settings of this launch, or None when the transformer is not to be sharded.

    On accelerators accelerate made the plugin (``accelerator.state.fsdp_plugin``); on a CPU-only machine
    accelerate runs the processes as plain gloo data parallel, and the plugin is read from the same
    ``FSDP_*`` variables the launcher set."""
    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
    elif fsdp_requested() and accelerator.distributed_type == DistributedType.MULTI_CPU:
        plugin = FullyShardedDataParallelPlugin()
        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)
    else:
        return None
    if plugin.fsdp_version != 2:
        raise UserError(f"the accelerate config asks for FSDP version {plugin.fsdp_version}; JAGG Studio shards the "
                        "transformer with FSDP2: set fsdp_version: 2 (presets/accelerate/fsdp.yaml)")
    if plugin.cpu_ram_efficient_loading:
        raise UserError("fsdp_cpu_ram_efficient_loading is not supported (the LoRA is not sharded and each process "
                        "loads the pipeline itself); set it to false")
    if plugin.reshard_after_forward is not True:
        raise UserError("fsdp_reshard_after_forward must be true: without it every process keeps the whole weights "
                        "of each block after its forward, and the processes' sharding states drift apart when rank 0 "
                        "alone saves the adapter")
    if plugin.activation_checkpointing:
        raise UserError("fsdp_activation_checkpointing renames the transformer's modules, which the diffusers LoRA "
                        "file relies on; set it to false and use train.gradient_checkpointing instead")
    return plugin


class Sharding:
    """The transformer's sharding in this run (``enabled`` False: not sharded, plain data parallel or one process)."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.plugin = fsdp_plugin(accelerator)
        self.enabled = self.plugin is not None
        self.record: dict = {}

    def prepare(self, model: FlowModel, optimizer: torch.optim.Optimizer):
        """Shard ``model``'s trained transformers (when enabled; a two-expert model's ``model.expert: both``: each
        expert on its own) and return the optimizer of the LoRA parameters, prepared by accelerate. The LoRA
        parameters are the same tensors before and after."""
        if not self.enabled:
            return self.accelerator.prepare(optimizer)
        if any(type(p).__name__ == "Params4bit" or type(p.data) is not torch.Tensor
               for transformer in model.trained_transformers for p in transformer.parameters()):
            raise UserError("a quantized transformer (model.quantize) cannot be sharded with FSDP; shard its bf16 "
                            "weights instead (model.quantize=none, model.dtype=bfloat16) or train it without sharding")
        lora = [param for group in optimizer.param_groups for param in group["params"]]
        if self.plugin.ignored_modules is None:
            self.plugin.ignored_modules = LORA_MODULES
        elif isinstance(self.plugin.ignored_modules, str):
            self.plugin.ignored_modules = f"(?:{self.plugin.ignored_modules})|(?:{LORA_MODULES})"
        for component in model.trained_components:
            transformer = getattr(model.pipe, component)
            sharded = fsdp2_prepare_model(self._accelerate_view(), transformer)
            # the root unit too (FSDP keeps it whole after a forward by default): between transformer calls every
            # process holds only its shards, so rank 0 alone can read the LoRA's state dict for a checkpoint
            # (state_dict() reshards first) without leaving the processes in different states
            sharded.set_reshard_after_forward(True)
            if sharded is not transformer:  # fully_shard works in place; keep the pipeline's module the one trained
                setattr(model.pipe, component, sharded)
        in_model = {id(p) for transformer in model.trained_transformers
                    for name, p in transformer.named_parameters() if "lora_" in name}
        if in_model != {id(p) for p in lora} or any(_is_sharded(p) for p in lora):
            raise RuntimeError("sharding the transformer replaced or sharded its LoRA parameters")
        self.record = self._describe(model, lora)
        return self.accelerator.prepare_optimizer(optimizer)

    def _accelerate_view(self):
        """What accelerate's ``fsdp2_prepare_model`` reads of an Accelerator: the accelerator itself where
        accelerate runs FSDP, the same fields with this launch's plugin on a CPU-only machine."""
        accelerator = self.accelerator
        if accelerator.distributed_type == DistributedType.FSDP:
            return accelerator
        return SimpleNamespace(state=SimpleNamespace(fsdp_plugin=self.plugin), torch_device_mesh=None,
                               parallelism_config=None, mixed_precision=accelerator.mixed_precision,
                               is_main_process=accelerator.is_main_process, device=accelerator.device)

    def _describe(self, model: FlowModel, lora: list[torch.Tensor]) -> dict:
        """How the trained transformers are sharded, for status.json: which, the number of shards, of FSDP units,
        and the fraction of their frozen weights each process holds."""
        from torch.distributed.fsdp import FSDPModule

        lora_ids = {id(p) for p in lora}
        frozen = [p for transformer in model.trained_transformers for p in transformer.parameters()
                  if id(p) not in lora_ids]
        total = sum(p.numel() for p in frozen)
        local = sum(p.to_local().numel() if _is_sharded(p) else p.numel() for p in frozen)
        held = self.accelerator.gather(torch.tensor([local], dtype=torch.float64, device=self.accelerator.device))
        shards = max((p.device_mesh.size() for p in frozen if _is_sharded(p)), default=1)
        return {"strategy": "fsdp2", "components": list(model.trained_components), "shards": int(shards),
                "units": sum(isinstance(m, FSDPModule) for t in model.trained_transformers for m in t.modules()),
                "frozen_parameters": int(total), "held_fraction": [round(float(h) / total, 4) for h in held.cpu()],
                "lora_parameters": int(sum(p.numel() for p in lora)), "lora_sharded": False}

    def describe_line(self) -> str:
        r = self.record
        return (f"{' and '.join(r['components'])} sharded with FSDP2 over {r['shards']} processes in {r['units']} "
                f"units: each holds "
                f"{', '.join(f'{100 * f:.1f}%' for f in r['held_fraction'])} of its {r['frozen_parameters']:,} "
                f"frozen weights; the LoRA ({r['lora_parameters']:,} weights) is whole on every process")

    # ----- keeping the processes' transformer calls matched -----------------------------------
    def agree(self, scores: list[float]) -> list[float]:
        """Each window's score averaged over the processes, the same on every process (a gather, then the
        same sum in the same order everywhere)."""
        local = torch.tensor([scores], dtype=torch.float64, device=self.accelerator.device)
        return self.accelerator.gather(local).mean(dim=0).tolist()

    def check_same_plan(self, plan: BackwardPlan) -> None:
        """Fail, instead of hanging in a collective, when the processes planned different transformer passes."""
        signature = torch.tensor([[len(plan.pass_steps), len(plan.interpolated), int(plan.joint),
                                   *map(int, plan.use_jagg)]], device=self.accelerator.device)
        gathered = self.accelerator.gather(signature)
        if not bool((gathered == gathered[0]).all()):
            raise RuntimeError(f"the processes planned different backward passes ({gathered.tolist()}); under a "
                               "sharded transformer they would wait on each other for ever")


def _is_sharded(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(param, DTensor)
