"""Sample a prompt of one's own with a run's adapter, beside the base model, as the run's evals do (the same
fixed-seed ODE sampler and sizes)::

    python -m jagg_core.generate RUN "a red circle on a blue background" --out pair.png [--seed 0]
    python -m jagg_core.generate RUN "a red circle" --out pair.png --checkpoint best   # or iter_N; default: latest
    python -m jagg_core.generate RUN "make it blue" --image in.png --out pair.png     # an image-editing run
    python -m jagg_core.generate RUN "put the cat on the sofa" --image cat.png --image sofa.png --out pair.png

It writes one picture: the base model on the left, the adapter on the right, the same noise (of a video model, the
videos' middle frames). An image-editing model (FLUX.1 Kontext, Qwen-Image-Edit) takes the prompt as the
instruction applied to ``--image`` (given ``model.input_images`` times, 'Picture 1' first), shown first, as wide as
the output. By default (``--shape input``) the whole picture is edited, as the pipelines edit one: the output and
the input take the run's sizes' areas (``sampling.resolution``, ``model.condition_resolution``) in the shape of
'Picture 1' (:meth:`~jagg_core.image_size.ImageSize.shaped_like`; the other pictures are centre-cropped to it);
``--shape run`` samples at the run's own sizes, each picture centre-cropped to the input's shape, as the run's evals
and rollouts saw their inputs. A prompt longer than a text encoder reads is said on stderr
(``jagg_core.generate: note: ...``) and sampled cut, as the pipelines do. The page's "Try it" panel runs this in its
own process, so the app never holds a model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .adapters import choose_adapter
from .edit_prompts import EditPrompt, checked_image_bytes, upright_image
from .errors import UserError, exit_on_user_error, made_folder
from .preflight import model_family
from .rundir import RunDirectory

PROG = "jagg_core.generate"
#: what follows ``jagg_core.generate:`` on a line that tells of the prompt without stopping (the page shows it)
NOTE = "note:"


def input_image_bytes(image: Path) -> bytes:
    """The bytes of the input image file ``image``; a missing or unreadable file is a :class:`UserError`."""
    try:
        data = image.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read the input image {image}: {err.strerror or err}") from None
    return checked_image_bytes(data, f"the input image {image}")


def shaped_like_picture(config, picture: bytes):
    """``config`` with its output and input sizes (``sampling.resolution``, ``model.condition_resolution``) at their
    areas in the shape of the encoded ``picture`` (:meth:`~jagg_core.image_size.ImageSize.shaped_like`)."""
    from .config import with_overrides
    width, height = upright_image(picture).size
    return with_overrides(config, [
        f"sampling.resolution={config.sampling.size.shaped_like(width, height).config_value()}",
        f"model.condition_resolution={config.model.condition_size.shaped_like(width, height).config_value()}"])


def adapter_model(config, rows: list[str], adapter_file: Path, scoring: bool = False):
    """``(model, sigmas)``: the run's base model on this machine's GPU (else the CPU) with ``rows`` encoded, its text
    encoders released, and the run's LoRA ``adapter_file`` loaded (``model.adapters_disabled()`` samples
    the base model); the run's eval schedule (``sampling.eval_num_steps``, else ``num_steps``). On a GPU whose free
    memory cannot hold the model's weights (``scoring``: and the run's rewards and judges, which the caller loads),
    a one-line :class:`UserError` first (:func:`~jagg_core.memory_plan.check_room_to_sample`)."""
    import torch

    from .memory_plan import check_room_to_sample
    from .models import load_flow_model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        check_room_to_sample(config, torch.cuda.mem_get_info(device)[0], scoring)
    model = load_flow_model(config.model, device, seed=config.train.seed, num_frames=config.sampling.num_frames)
    model.check_size(config.sampling.size)
    model.encode_and_cache(rows)
    model.release_text_encoders()
    model.add_lora(config.lora)
    model.load_lora(adapter_file)
    return model, model.sigmas(config.sampling.eval_num_steps or config.sampling.num_steps, config.sampling.size)


def generate(run_dir: Path, prompt: str, checkpoint: str | None = None, seed: int = 0,
             images: list[Path] | tuple[Path, ...] = (), shape: str = "input"):
    """A PIL image of ``prompt``: the base model's sample beside the adapter's (the latest, ``best`` or ``iter_N``:
    :func:`~jagg_core.adapters.choose_adapter`), from the same noise; for an image-editing run, ``prompt`` is the
    instruction applied to ``images``, shown first, at the run's sizes' areas in the shape of the first (``shape``
    input) or at the run's sizes (``run``)."""
    from .config import validate_config
    from .quiet import log_to_stderr, quiet_libraries
    quiet_libraries()
    import torch

    from .images import captioned_grid, still_frames, to_pil
    from .models.text_windows import prompt_notes
    from .sampler import initial_noise, ode_sample

    config = validate_config(RunDirectory(run_dir).read_config())
    adapter = choose_adapter(run_dir, checkpoint)
    if not prompt.strip():
        raise UserError("type a prompt")
    row = EditPrompt(prompt, tuple(input_image_bytes(image) for image in images),
                     "+".join(image.name for image in images)) if images else prompt
    family = model_family(config.model)  # before the model loads (None: the load says why it cannot)
    wanted = family.input_images(config.model.input_images) if family is not None else 0
    editing = wanted > 0
    if editing and len(images) != wanted:
        what, how = (("the image", "--image PATH; on the page, Input image") if wanted == 1 else
                     (f"the {wanted} images", f"--image PATH {wanted} times, 'Picture 1' first; on the page, Input "
                                              f"image and Picture 2{' and 3' if wanted == 3 else ''}"))
        applies = "its videos start from" if family.image_to_video else "the instruction applies to"
        raise UserError(f"the run's model ({family.label}) {family.does_with_images}: give {what} {applies} ({how})")
    if images and family is not None and not editing:
        raise UserError(f"the run's model ({family.label}) generates from the prompt alone; leave out the input image")
    if editing and shape == "input":
        config = shaped_like_picture(config, row.images_bytes[0])
    model, sigmas = adapter_model(config, [row], adapter.file)
    for note in prompt_notes(model.read_text_windows([row])):
        log_to_stderr(f"{PROG}: {NOTE} {note}")
    size = config.sampling.size
    z0 = initial_noise(model, 1, size, torch.Generator().manual_seed(seed))
    cond = model.conditioning([row])
    with torch.no_grad():
        with model.adapters_disabled():
            base = model.decode_samples(ode_sample(model, cond, sigmas, z0), cond)
        tuned = model.decode_samples(ode_sample(model, cond, sigmas, z0), cond)
    pictures, captions = to_pil(torch.cat([still_frames(base), still_frames(tuned)]).cpu()), ["base model",
                                                                                              adapter.label]
    if editing:
        inputs = row.images(config.model.condition_size)
        names = ["input image"] if len(inputs) == 1 else [f"picture {k}" for k in range(1, len(inputs) + 1)]
        pictures, captions = [*inputs, *pictures], [*names, *captions]
    return captioned_grid(pictures, captions, title=prompt[:80], columns=len(captions), cell=max(256, size.width))


def picture_path(out: Path) -> Path:
    """``out`` once a picture can be written there: its suffix names a format PIL writes (else a :class:`UserError`
    before anything is sampled), its folder made as needed."""
    from PIL import Image

    if Image.registered_extensions().get(out.suffix.lower()) not in Image.SAVE:
        raise UserError(f"--out {out}: name a picture file, such as pair.png (or .jpg, .webp)")
    made_folder(out.parent)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run directory")
    parser.add_argument("prompt")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--checkpoint", metavar="best|iter_N",
                        help="the best adapter (RUN/best) or a checkpoint's (default: the latest adapter)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", type=Path, metavar="PATH", action="append", default=[],
                        help="an image-editing run's input image, to which the prompt's instruction applies "
                             "(repeat for a run of several input images a row, 'Picture 1' first)")
    parser.add_argument("--shape", choices=("input", "run"), default="input",
                        help="an image-editing run's sizes: input = the run's sizes' areas in the shape of the (first) "
                             "input image, which is edited whole (default); run = the run's own sizes, the input "
                             "centre-cropped to them")
    args = parser.parse_args(argv)
    with exit_on_user_error(PROG):
        out = picture_path(Path(args.out))
        picture = generate(Path(args.run_dir), args.prompt, args.checkpoint, args.seed, args.image, args.shape)
        try:
            picture.save(out)
        except OSError as err:
            raise UserError(f"cannot write {out}: {err.strerror or err}") from None
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
