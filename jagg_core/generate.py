"""Sample a prompt of one's own with a run's adapter, beside the base model, as the run's evals do (the same
fixed-seed ODE sampler and sizes)::

    python -m jagg_core.generate RUN "a red circle on a blue background" --out pair.png [--seed 0]
    python -m jagg_core.generate RUN "a red circle" --out pair.png --checkpoint best   # or iter_N; default: latest

It writes one picture: the base model on the left, the adapter on the right, the same noise (of a video model, the
videos' middle frames). The page's "Try the
adapter" panel runs this in its own process, so the app never holds a model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .adapters import choose_adapter
from .errors import UserError, exit_on_user_error
from .rundir import RunDirectory

PROG = "jagg_core.generate"


def generate(run_dir: Path, prompt: str, checkpoint: str | None = None, seed: int = 0):
    """A PIL image of ``prompt``: the base model's sample beside the adapter's (the latest, ``best`` or ``iter_N``:
    :func:`~jagg_core.adapters.choose_adapter`), from the same noise."""
    from .config import validate_config
    from .quiet import quiet_libraries
    quiet_libraries()
    import torch

    from .images import captioned_grid, still_frames, to_pil
    from .models import load_flow_model
    from .sampler import initial_noise, ode_sample

    config = validate_config(RunDirectory(run_dir).read_config())
    adapter = choose_adapter(run_dir, checkpoint)
    if not prompt.strip():
        raise UserError("type a prompt")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_flow_model(config.model, device, seed=config.train.seed, num_frames=config.sampling.num_frames)
    model.encode_and_cache([prompt])
    model.release_text_encoders()
    model.add_lora(config.lora)
    steps, size = config.sampling.eval_num_steps or config.sampling.num_steps, config.sampling.resolution
    sigmas = model.sigmas(steps, size)
    z0 = initial_noise(model, 1, size, torch.Generator().manual_seed(seed))
    cond = model.conditioning([prompt])
    with torch.no_grad():
        model.transformer.disable_adapters()
        base = model.decode(ode_sample(model, cond, sigmas, z0))
        model.transformer.enable_adapters()
        model.load_lora(adapter.file)
        tuned = model.decode(ode_sample(model, cond, sigmas, z0))
    return captioned_grid(to_pil(still_frames(torch.cat([base, tuned]))), ["base model", adapter.label],
                          title=prompt[:80], columns=2, cell=max(256, size))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run directory")
    parser.add_argument("prompt")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--checkpoint", metavar="best|iter_N",
                        help="the best adapter (RUN/best) or a checkpoint's (default: the latest adapter)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with exit_on_user_error(PROG):
        generate(Path(args.run_dir), args.prompt, args.checkpoint, args.seed).save(args.out)
        print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
