"""The page: set-up form, job buttons, live view and push panel, and their event handlers.

Stable API endpoints (``gradio_client``):

    /start    the set-up form's fields (``START_PARAMS``, e.g. train_iterations=3) -> (message, run name)
    /stop     -> message                       ends the active job; its last checkpoint stays
    /resume   run name, processes -> (message, run name)  continues a stopped or failed run from its last checkpoint
              on ``processes`` processes (the page's field, which takes the chosen run's count; an explicit null:
              as many as it ran on)
    /status   run name ("" = the active run, else the newest) -> dict (see :meth:`Studio.status`)
    /push     run, adapter ("latest adapter", best, iter_N), repo id, visibility, token -> message with the repo link
    /load_preset  preset -> the form's fields
    /export   the set-up form's fields -> (the run config YAML file, the equivalent ``python -m jagg_core.run`` command)
    /delete   run name -> (message, run name)  deletes a run that is not training
    /generate run, adapter, prompt, seed[, input image] -> (image, message)  the base model beside the adapter for
              one's own prompt (an image-editing run's: an instruction and the image it applies to)
    /evaluate run, adapter, prompt set ("" = the run's held-out prompts), prompts at most (0 = all), images per
              prompt[, against: another run ("" = the base model), its adapter ("latest adapter", best, iter_N)] ->
              (image, table) of ``python -m jagg_core.evaluate``: first samples, each reward's and judge's means
    /queue_up, /queue_down, /queue_remove  queued run -> (message, queue words, queued runs)  reorder or empty the
              queue (Start while a run trains queues the new run)

On a Hugging Face Space only the owner and the users in ``JAGG_ALLOWED_USERS`` may start, stop, resume, push, delete,
generate or evaluate (:mod:`app.access`); everyone can watch. The handlers only launch and signal processes
(:mod:`app.jobs`) and read run directories (:mod:`app.live`); the form is turned into a run config by :mod:`app.form`.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from jagg_core import hub
from jagg_core.adapters import LATEST_LABEL as LATEST_ADAPTER
from jagg_core.config import DEFAULT_PRESET, list_presets, validate_config
from jagg_core.errors import UserError
from jagg_core.evaluate import PROG as EVALUATE
from jagg_core.evaluate import GRID_FILE as EVALUATION_GRID
from jagg_core.evaluate import TABLE_FILE as EVALUATION_TABLE
from jagg_core.generate import NOTE
from jagg_core.model_card import read_evaluation
from jagg_core.generate import PROG as GENERATE
from jagg_core.preflight import input_images_a_row
from jagg_core.prompts import ARCHIVE_SUFFIX, FILE_SUFFIXES, builtin_prompt_sets
from jagg_core.rewards import available_rewards
from jagg_core.rundir import RunDirectory

from . import access, live
from .form import (ADVANCED_KNOBS, ALGORITHM_KNOBS, KNOBS, MAIN_KNOBS, PROMPT_MODES, PROMPTS_BUILTIN, PROMPTS_TEXT,
                   PROMPTS_UPLOAD, Form, Knob, build_config, checked_config, cli_command, config_form, model_choices,
                   preset_form, prompt_preview, reward_words, weight_rows)
from .jobs import JobControl, queue_placement, runs_root
from .system import gpu_free_gb, gpu_rows, hardware_words, placement_for, process_choices, sampling_environment

REFRESH_S = 1.5
HARDWARE_REFRESH_S = 5.0
LIVE_EVENTS = "live"  # the concurrency group of the events that refresh what the page shows
SERIES_COLORS = ("#2563eb", "#f97316", "#16a34a", "#dc2626", "#9333ea", "#0891b2", "#ca8a04", "#db2777")
PRIVATE, PUBLIC = "private", "public"
FORM_FIELDS = ("preset", "name", "model", "rewards", "weights", "prompt_mode", "prompt_set", "prompt_file",
               "prompt_text", "eval_text")
#: the fields a reloaded page fills from the active run's config (then the knobs)
RESTORED_FIELDS = ("name", "model", "rewards", "weights", "prompt_mode", "prompt_set", "prompt_text", "eval_text")
# /start's parameters: the form fields, then each knob named by its config key (``train.iterations`` ->
# ``train_iterations``), so that API clients can pass ``train_iterations=3`` and leave the rest at the defaults.
# and last ``processes`` (None: :func:`~app.system.process_choices`'s default).
START_PARAMS = FORM_FIELDS + tuple(k.key.replace(".", "_") for k in KNOBS) + ("processes",)
#: API parameters that may be left out (null: the schema's default); they come last
OPTIONAL_PARAMS = {k.key.replace(".", "_") for k in KNOBS if k.optional} | {"processes"}
COMPARE_ITERATIONS, COMPARE_MINUTES = "iterations", "training minutes"
COMPARE_HINT = "Choose two or more runs to compare them."
#: Try it's image boxes (label, elem_id), 'Picture 1' first: the chosen run's model.input_images of them show
TRY_INPUTS = (("Input image (editing; image-to-video: the first frame)", "try-input"),
              ("Picture 2 (runs of 2 or 3 input images)", "try-input-2"),
              ("Picture 3 (runs of 3 input images)", "try-input-3"))
CSS = """
#title h1 {margin-bottom: 0}
#form-message, #push-result, #run-message, #try-message, #queue-message {min-height: 1.5em}
.run-progress {display: flex; align-items: center; gap: 0.75em}
.run-progress progress {flex: 1; height: 0.9em}
"""
# a finished run's log opens at its end, as a live one follows it
SCROLL_LOG_TO_END = "() => { const box = document.querySelector('#log textarea'); if (box) box.scrollTop = box.scrollHeight; }"
CONFIRM_DELETE = "(run) => (run && confirm(`Delete the run ${run} and all its files?`)) ? run : null"


def _knob_component(knob: Knob, value: Any, algorithm: str) -> gr.components.Component:
    """The widget of one knob; shown when every algorithm reads its key, or ``algorithm`` does."""
    common = {"label": knob.label, "info": knob.info or None, "elem_id": knob.elem_id,
              "visible": knob.algorithm in (None, algorithm)}
    if knob.kind == "bool":
        return gr.Checkbox(value=value, **common)
    if knob.kind == "choice":
        return gr.Dropdown(choices=list(knob.choices), value=value, **common)
    if knob.kind == "size":
        return gr.Dropdown(choices=list(knob.choices), value=value, allow_custom_value=True, **common)
    if knob.kind == "specs":
        return gr.Dropdown(choices=list(knob.choices), value=value, multiselect=True, **common)
    if knob.kind == "multi":
        return gr.CheckboxGroup(choices=list(knob.choices), value=value, **common)
    return gr.Number(value=value, precision=0 if knob.kind == "int" else None, **common)


def _grid(knobs: tuple[Knob, ...], values: dict, per_row: int) -> dict[str, gr.components.Component]:
    """The knobs' widgets, ``per_row`` a row; config key -> widget."""
    components = {}
    for start in range(0, len(knobs), per_row):
        with gr.Row():
            components |= {k.key: _knob_component(k, values[k.key], values["train.algorithm"])
                           for k in knobs[start:start + per_row]}
    return components


def algorithm_chosen(algorithm: str) -> list:
    """Every knob's visibility under ``algorithm``: those of the other algorithms hide."""
    return [gr.update(visible=knob.algorithm in (None, algorithm)) for knob in KNOBS]


def _colors(labels) -> dict[str, str]:
    """A fixed colour per series label. The plot's legend is fixed by its first data otherwise, and a series that
    appears later (the first eval after the first rollouts) would not be drawn."""
    return dict(zip(labels, itertools.cycle(SERIES_COLORS)))


def _series_plot(kind: str, curve, run_dir: Path | None, seen: dict, signature: Any):
    """The update of the plot ``kind`` (the judges plot, the rewards' signal plot) for ``run_dir``, whose metrics file
    has ``signature``: its frame (``curve(run_dir)``) and colour map, shown from two series, or nothing new.
    Its series differ between runs, and the page's plot draws only the series it was drawn with, when it got its first
    frame: so before a frame with other series than those the page holds (``seen``), the plot is emptied, and its
    next frame draws it anew."""
    if seen.get(kind) == signature:
        return gr.skip()
    frame = curve(run_dir) if run_dir else None
    series = tuple(dict.fromkeys(frame["series"])) if frame is not None else ()
    held = f"{kind}_series"
    if seen.get(held) and seen[held] != series:
        seen[held] = ()
        return gr.update(value=None)
    seen[kind], seen[held] = signature, series
    return gr.update(value=frame, color_map=_colors(series), visible=len(series) > 1)


def _judge_plot(run_dir: Path | None, seen: dict, signature: Any):
    """The judges plot (the eval reward's series and each judge's): hidden for a run without judges."""
    return _series_plot("judge", live.judge_curve, run_dir, seen, signature)


def _spread_plot(run_dir: Path | None, seen: dict, signature: Any):
    """The rewards' signal plot (each reward's ``reward_spread``): shown for a run of several rewards."""
    return _series_plot("spread", live.spread_curve, run_dir, seen, signature)


def _curves(run_dir: Path | None) -> tuple:
    """The reward, loss and fidelity plots' updates (:func:`live.curves`): the fidelity plot, a point per audit (a
    line of one point draws nothing), is shown once the run has an audit: a run that audits nothing (exact, NFT, AWM,
    ``backward.audit_every: 0``) never shows an empty plot, and one that does shows it from its first audit."""
    if run_dir is None:
        return None, None, gr.update(value=None, visible=False)
    rewards, losses, fidelity = live.curves(run_dir)
    x_lim, y_lim = live.fidelity_limits(run_dir, fidelity)
    return rewards, losses, gr.update(value=fidelity, visible=bool(fidelity["value"].notna().any()), x_lim=x_lim,
                                      y_lim=y_lim)


def _forget_shown(seen: dict) -> dict:
    """What the page shows, forgotten so that a refresh sends it all again (after the user picks a run), but for the
    series of the judges plot and the rewards' signal plot, which the plots keep (:func:`_series_plot`)."""
    return {held: seen.get(held) for held in ("judge_series", "spread_series")}


def _dropdown(choices: list, pick: str | None, requested: str | None):
    """A refreshed dropdown: its new ``choices``, and its value only where the refresh changed the pick from the one
    the page sent (``requested``). A timer tick sent before the user picks something answers after the pick; were it
    to send its value, it would put back the pick the user had just left."""
    return gr.update(choices=choices) if pick == requested else gr.update(choices=choices, value=pick)


def _named(fn, names: tuple[str, ...]):
    """``fn(*values, profile=...)`` with a signature naming its parameters, which Gradio shows as the API's parameter
    names, and a last ``profile`` parameter into which Gradio injects the signed-in user (not an API parameter)."""
    def named(*values):
        *fields, profile = values
        return fn(*fields, profile=profile)

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    named.__signature__ = inspect.Signature(
        [inspect.Parameter(name, positional, **({"default": None} if name in OPTIONAL_PARAMS else {}))
         for name in names]
        + [inspect.Parameter("profile", positional, default=None, annotation=gr.OAuthProfile | None)])
    named.__annotations__ = {"profile": gr.OAuthProfile | None}
    named.__doc__ = fn.__doc__
    return named


def _refusal(profile: gr.OAuthProfile | None) -> str | None:
    """Why the signed-in user (``profile``) may not control jobs here (:mod:`app.access`), or None."""
    return access.refusal(profile.username if profile is not None else None)


#: images per prompt the page's Evaluate takes at most
MAX_EVALUATION_IMAGES = 64


def _command_error(result: subprocess.CompletedProcess, prog: str) -> str:
    """Why a project command (``python -m PROG``) failed: its last ``PROG: error:`` line, else its exit code."""
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"{prog}: error:")]
    return errors[-1].split("error:", 1)[1].strip() if errors else f"exit code {result.returncode}"


def _oauth_available() -> bool:
    """Sign-in with Hugging Face works on a Space with the OAuth extras installed."""
    return bool(os.environ.get("SPACE_ID")) and importlib.util.find_spec("authlib") is not None



def _form(values) -> Form:
    """The set-up form from the page's values, in the order of ``START_PARAMS``."""
    fields = dict(zip(FORM_FIELDS, values))
    return Form(preset=fields["preset"] or "", name=fields["name"] or "", model=fields["model"] or "",
                rewards=list(fields["rewards"] or []), weights=fields["weights"] or [],
                prompt_mode=fields["prompt_mode"], prompt_set=fields["prompt_set"] or "",
                prompt_file=fields["prompt_file"], prompt_text=fields["prompt_text"] or "",
                eval_text=fields["eval_text"] or "",
                knobs={k.key: value for k, value in zip(KNOBS, values[len(FORM_FIELDS):])})


def _memory_warning(config, plan, free_gb: float | None) -> str:
    """A warning when the run's memory ``plan`` does not fit ``free_gb`` of GPU memory (the run starts anyway: the
    plan is an estimate); nothing without a GPU or a plan."""
    from jagg_core.memory_plan import check_fits  # torch: loaded on first use
    if plan is None or free_gb is None:
        return ""
    verdict = check_fits(plan, config, free_gb)
    return f" **Warning: {verdict}.**" if verdict.startswith("does not fit") else ""


def _processes(value) -> int:
    """The Processes field's count: a whole number from 1 to the machine's most; empty: the default."""
    default, most = process_choices()
    try:
        return max(1, min(most, int(value)))
    except (TypeError, ValueError):
        return default


def _placement_words(placement, why: str) -> str:
    """`` (2 processes, data parallel: the plan (…) fits each GPU …)``; nothing for one process."""
    if placement.processes <= 1:
        return ""
    return f" ({placement.processes} processes, {why})" if why else f" ({placement.words()})"


def _download_words(plan) -> str:
    """``: the base model OWNER/NAME: 23.8 GB to download first (of 33.1 GB)`` when the pre-flight's download plan
    has bytes left, else nothing."""
    if plan is None or plan.left <= 0:
        return ""
    return f"; {plan.summary().replace(' to download', ' to download first')}"


class Studio:
    """The event handlers, bound to one runs root."""

    def __init__(self, root: Path):
        self.jobs = JobControl(root)
        #: the folder of the page's last evaluation of each (run, adapter choice)
        self.evaluations: dict[tuple[str, str | None], Path] = {}

    # ----- helpers ---------------------------------------------------------------------------
    def _run_dir(self, name: str | None) -> Path | None:
        """The run called ``name``; without a name, the active run, else the newest."""
        if name:
            return self.jobs.run_dir(name)
        job = self.jobs.active()
        if job is not None:
            return job.run_dir
        runs = self.jobs.runs()
        return runs[0] if runs else None

    @staticmethod
    def _refuse(message: str) -> tuple[str, Any]:
        gr.Warning(message)
        return f"**Not started:** {message}", gr.skip()

    # ----- set-up ----------------------------------------------------------------------------
    def load_preset(self, preset: str) -> tuple:
        """Fill the form from a preset."""
        form = preset_form(preset)
        return (list_presets().get(preset, ""), form.name, form.model, form.rewards, form.weights,
                form.prompt_mode, form.prompt_set, *(form.knobs[k.key] for k in KNOBS))

    @staticmethod
    def prompt_mode_changed(mode: str, prompt_set: str, text: str) -> tuple:
        """Show the widget of the chosen prompt source; writing one's own starts from the chosen set."""
        if mode == PROMPTS_TEXT and not text.strip() and prompt_set in builtin_prompt_sets():
            text = prompt_preview(prompt_set)
        return (gr.update(visible=mode == PROMPTS_BUILTIN), gr.update(visible=mode == PROMPTS_UPLOAD),
                gr.update(visible=mode == PROMPTS_TEXT, value=text))

    # ----- job control -----------------------------------------------------------------------
    def start(self, *values, profile: gr.OAuthProfile | None = None) -> tuple[str, Any]:
        """Validate the form (``values`` in the order of ``START_PARAMS``), write RUN/config.yaml and launch the
        job; while a run trains, queue the new run instead (:mod:`jagg_core.run_queue`: it starts when the machine
        frees); refuse with the reason otherwise."""
        if refused := _refusal(profile):
            return self._refuse(refused)
        busy = self.jobs.active()
        training = busy.run_dir if busy is not None else self.jobs.trained_elsewhere()
        form = _form(values)
        processes = _processes(dict(zip(START_PARAMS, values)).get("processes"))
        run_dir = self.jobs.new_run_dir(form.name or form.preset)
        try:
            config, download = checked_config(form, run_dir)
            free_gb = gpu_free_gb()
            plan = None
            if free_gb is not None and (training is None or processes > 1):  # one plan: the warning, the placement
                from jagg_core.memory_plan import plan_memory  # torch: loaded on first use
                plan = plan_memory(config)
            warning = _memory_warning(config, plan, free_gb) if training is None else ""
            placement, why = placement_for(config, processes, plan)
            RunDirectory(run_dir).write_config(config.to_yaml())
            if training is not None:
                queue_placement(run_dir, placement)
                position = self.jobs.queue.add(run_dir)
            else:
                self.jobs.launch(run_dir, config.train.mixed_precision, placement=placement)
        except (UserError, OSError) as err:
            shutil.rmtree(run_dir, ignore_errors=True)
            return self._refuse(str(err))
        chosen = gr.update(choices=self._run_names(), value=run_dir.name)
        if training is not None:
            return (f"Queued `{run_dir.name}` at position {position}: it starts when `{training.name}` ends"
                    f"{'' if position == 1 else f' and the {position - 1} before it have run'}"
                    f"{_placement_words(placement, why)}{_download_words(download)}.", chosen)
        return (f"Started `{run_dir.name}`{_placement_words(placement, why)}{_download_words(download)}.{warning}",
                chosen)

    @staticmethod
    def plan(*values) -> str:
        """The memory plan of the form (``values`` as for :meth:`start`): its parts, whether it fits this
        machine's GPU, naming the cheapest change that does when not, and whether the host holds its
        text-embedding cache."""
        from jagg_core.memory_plan import check_fits, check_host, plan_memory  # torch: loaded on first use
        free = gpu_free_gb()
        processes = _processes(dict(zip(START_PARAMS, values)).get("processes"))
        try:
            with tempfile.TemporaryDirectory() as scratch:
                config = build_config(_form(values), Path(scratch))
            memory = plan_memory(config)
            verdict = check_fits(memory, config, free)
            host = check_host(memory, runs_root(), processes)
        except UserError as err:
            return f"**Cannot plan:** {err}"
        where = "" if free is not None else " (no CUDA GPU here: compare with your card)"
        host = f"\n\n**{host}**" if host else ""
        return f"**{verdict}**{where}{host}\n\n```\n{memory.table()}\n```"

    @staticmethod
    def export(*values) -> tuple[str | None, str]:
        """The form's run config (``values`` as for :meth:`start`) as a YAML file for ``--config``, and the
        ``python -m jagg_core.run --preset ... --set ...`` command that resolves to the same config."""
        form = _form(values)
        folder = Path(tempfile.mkdtemp(prefix="jagg-export-"))  # also holds typed prompts, which the YAML names
        try:
            config = build_config(form, folder)
        except UserError as err:
            return None, f"# cannot export: {err}"
        path = folder / f"{config.name.replace('/', '-') or 'run'}.yaml"
        path.write_text(config.to_yaml())
        return str(path), cli_command(config, form.preset)

    def active_form(self) -> tuple:
        """The form of the active run's config, so a reloaded page shows what is training (else nothing changes)."""
        job = self.jobs.active()
        skip = [gr.skip()] * (len(RESTORED_FIELDS) + len(KNOBS))
        if job is None:
            return tuple(skip)
        try:
            config = validate_config(RunDirectory(job.run_dir).read_config())
        except UserError:
            return tuple(skip)
        form = config_form(config, preset="", run_dir=job.run_dir)
        return (form.name, form.model, form.rewards, form.weights, form.prompt_mode, form.prompt_set,
                form.prompt_text, form.eval_text, *(form.knobs[k.key] for k in KNOBS))

    def delete(self, name: str | None, profile: gr.OAuthProfile | None = None) -> tuple[str, Any]:
        """Delete a run's folder, unless a process is training it."""
        if refused := _refusal(profile):
            return f"**Not deleted:** {refused}", gr.skip()
        run_dir = self.jobs.run_dir(name) if name else None
        if run_dir is None:
            return "**Not deleted:** choose a run.", gr.skip()
        job = self.jobs.active()
        if (job is not None and job.run_dir == run_dir) or RunDirectory(run_dir).trainer_alive():
            return f"**Not deleted:** `{run_dir.name}` is training; stop it first.", gr.skip()
        if self.jobs.queue.position(run_dir.name) is not None:
            self.jobs.queue.remove(run_dir.name)
        shutil.rmtree(run_dir)
        names = self._run_names()
        return f"Deleted `{run_dir.name}`.", gr.update(choices=names, value=names[0] if names else None)

    def generate(self, run: str, checkpoint: str, prompt: str, seed: float | None, image: str | None = None,
                 picture_2: str | None = None, picture_3: str | None = None, whole: bool = True,
                 profile: gr.OAuthProfile | None = None) -> tuple[str | None, str]:
        """The base model's and the adapter's sample of ``prompt``, side by side, made by ``python -m
        jagg_core.generate`` in its own process (the app holds no model); ``image``: an image-editing run's input
        image (an upload), shown first; ``picture_2``, ``picture_3``: the next ones of a run whose rows have several
        (``model.input_images``), empty boxes left out; ``whole`` false: at the run's own sizes, the pictures
        centre-cropped to them (``--shape run``), not the whole picture in its shape."""
        if refused := _refusal(profile):
            return None, f"**Not generated:** {refused}"
        run_dir = self._run_dir(run)
        if run_dir is None:
            return None, "**Not generated:** choose a run first."
        if not (prompt or "").strip():
            return None, "**Not generated:** type a prompt."
        out = Path(tempfile.mkdtemp(prefix="jagg-generate-")) / "generated.png"
        command = [sys.executable, "-m", GENERATE, str(run_dir), prompt.strip(), "--out", str(out),
                   "--seed", str(int(seed or 0))]
        if live.adapter_name(checkpoint):
            command += ["--checkpoint", checkpoint]
        images = [path for path in (image, picture_2, picture_3) if path]
        for path in images:
            command += ["--image", path]
        if images and not whole:
            command += ["--shape", "run"]
        result = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                env=sampling_environment())
        if result.returncode != 0 or not out.is_file():
            return None, f"**Not generated:** {_command_error(result, GENERATE)}"
        inputs = "the input image" if len(images) == 1 else f"the {len(images)} input images"
        shown = f"{inputs}, the base model's edit and the adapter's" if images else \
            "the base model (left) and the adapter"
        notes = [line.split(NOTE, 1)[1].strip() for line in result.stderr.splitlines()
                 if line.startswith(f"{GENERATE}: {NOTE}")]
        cut = "".join(f"  \n**Note:** {note}" for note in notes)
        return str(out), f"`{run_dir.name}`, {checkpoint or LATEST_ADAPTER}: {shown}{cut}"

    def evaluate(self, run: str, checkpoint: str, prompt_set: str | None, limit: float | None,
                 images_per_prompt: float | None, against: str | None = None, against_adapter: str | None = None,
                 profile: gr.OAuthProfile | None = None) -> tuple[str | None, str]:
        """The adapter against its base model (or the adapter ``against_adapter`` of the run ``against``: its latest,
        best or a checkpoint's, as :meth:`against_adapters` offers them) on prompts x noises, scored by the run's
        rewards and judges: the grid of samples and the table of ``python -m jagg_core.evaluate``, run in its own
        process (the app holds no model). ``prompt_set``: a built-in set, or empty for the run's held-out prompts;
        ``limit``: that many of its prompts (0: all). An evaluation against the base model is the one Publish puts
        into the model card (:meth:`evaluation_of`)."""
        if refused := _refusal(profile):
            return None, f"**Not evaluated:** {refused}"
        run_dir = self._run_dir(run)
        if run_dir is None:
            return None, "**Not evaluated:** choose a run first."
        if not 1 <= int(images_per_prompt or 0) <= MAX_EVALUATION_IMAGES or int(limit or 0) < 0:
            return None, (f"**Not evaluated:** give 1 to {MAX_EVALUATION_IMAGES} images per prompt and 0 or more "
                          "prompts at most")
        if prompt_set and prompt_set not in builtin_prompt_sets():
            return None, (f"**Not evaluated:** '{prompt_set}' is not a built-in prompt set; choose one, or none for "
                          "the run's")
        other = self.jobs.run_dir(against) if against else None
        if against and other is None:
            return None, f"**Not evaluated:** there is no run '{against}' to compare with; choose one of the runs"
        if other is not None and against_adapter not in (None, "", *(v for _, v in live.adapter_choices(other))):
            return None, (f"**Not evaluated:** the run '{against}' has no adapter '{against_adapter}'; choose one of "
                          "its adapters")
        out = Path(tempfile.mkdtemp(prefix="jagg-evaluate-"))
        command = [sys.executable, "-m", EVALUATE, str(run_dir), "--out", str(out),
                   "--images-per-prompt", str(int(images_per_prompt))]
        if prompt_set:
            command += ["--prompts", prompt_set]
        if limit:
            command += ["--limit", str(int(limit))]
        if live.adapter_name(checkpoint):
            command += ["--checkpoint", checkpoint]
        if other is not None:
            command += ["--against", str(other)]
            if live.adapter_name(against_adapter):
                command += ["--against-checkpoint", against_adapter]
        result = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                env=sampling_environment())
        if result.returncode != 0 or not (out / EVALUATION_TABLE).is_file():
            return None, f"**Not evaluated:** {_command_error(result, EVALUATE)}"
        if other is None:
            self.evaluations[(run_dir.name, live.adapter_name(checkpoint))] = out
        return str(out / EVALUATION_GRID), (out / EVALUATION_TABLE).read_text()

    def against_adapters(self, against: str | None) -> dict:
        """The adapters of the run ``against`` that Evaluate can compare with (:func:`live.adapter_choices`: its
        latest, best and checkpoints'), the latest chosen."""
        other = self.jobs.run_dir(against) if against else None
        choices = live.adapter_choices(other) if other else [(LATEST_ADAPTER, LATEST_ADAPTER)]
        return gr.update(choices=choices, value=LATEST_ADAPTER)

    def evaluation_of(self, run_dir: Path, checkpoint: str) -> Path | None:
        """The folder of the page's evaluation of ``run_dir``'s adapter ``checkpoint``, while it is of that adapter's
        weights (:func:`~jagg_core.model_card.read_evaluation`: a run that trained on since has a newer latest
        adapter), else None."""
        folder = self.evaluations.get((run_dir.name, live.adapter_name(checkpoint)))
        adapter = live.chosen_adapter(run_dir, checkpoint)
        if folder is None or adapter is None:
            return None
        try:
            read_evaluation(folder, run_dir, adapter)
        except UserError:
            return None
        return folder

    def stop(self, profile: gr.OAuthProfile | None = None) -> str:
        """Stop the active job (SIGTERM to its process group, SIGKILL after a grace period)."""
        if refused := _refusal(profile):
            return f"**Not stopped:** {refused}"
        job = self.jobs.stop()
        if job is None:
            return "No run is active."
        return f"Stopped `{job.run_dir.name}`; its last checkpoint is kept. Press **Resume** to continue."

    # ----- the queue ---------------------------------------------------------------------------
    def queue_view(self) -> tuple[str, Any]:
        """The Queue block: the queued runs with their positions (Markdown), and its dropdown of them."""
        names = self.jobs.queue.names()
        return live.queue_words(names), gr.update(choices=names, value=names[0] if names else None)

    def queue_move(self, name: str | None, offset: int, profile: gr.OAuthProfile | None = None) -> tuple:
        """Move the queued run ``name`` ``offset`` places (negative: sooner); (message, queue words, dropdown)."""
        if refused := _refusal(profile):
            return f"**Not moved:** {refused}", gr.skip(), gr.skip()
        try:
            position = self.jobs.queue.move(name or "", offset)
        except UserError as err:
            return f"**Not moved:** {err}", *self.queue_view()
        words, _ = self.queue_view()
        return (f"`{name}` is at position {position}.", words,
                gr.update(choices=self.jobs.queue.names(), value=name))

    def queue_up(self, name: str | None, profile: gr.OAuthProfile | None = None) -> tuple:
        """Move the queued run ``name`` one place sooner."""
        return self.queue_move(name, -1, profile=profile)

    def queue_down(self, name: str | None, profile: gr.OAuthProfile | None = None) -> tuple:
        """Move the queued run ``name`` one place later."""
        return self.queue_move(name, 1, profile=profile)

    def queue_remove(self, name: str | None, profile: gr.OAuthProfile | None = None) -> tuple:
        """Take the run ``name`` out of the queue; its folder stays (Resume starts it)."""
        if refused := _refusal(profile):
            return f"**Not removed:** {refused}", gr.skip(), gr.skip()
        try:
            self.jobs.queue.remove(name or "")
        except UserError as err:
            return f"**Not removed:** {err}", *self.queue_view()
        return f"Took `{name}` out of the queue; Resume starts it.", *self.queue_view()

    def resume(self, name: str, processes: float | None = None,
               profile: gr.OAuthProfile | None = None) -> tuple[str, Any]:
        """Relaunch a stopped, failed or interrupted run with ``--resume``, on ``processes`` processes (None: as many
        as it ran on before; another count changes what the run's batches are: the trainer logs what that means)."""
        if refused := _refusal(profile):
            return self._refuse(refused)
        run_dir = self._run_dir(name)
        if run_dir is None:
            return self._refuse("choose a run to resume")
        busy = self.jobs.active()
        if busy is not None:
            return self._refuse(f"a run is active ({busy.run_dir.name}); stop it before resuming another")
        if RunDirectory(run_dir).trainer_alive():
            return self._refuse(f"{run_dir.name} is training in a process started outside this page; "
                                "it cannot be resumed twice")
        state = live.progress(run_dir).state
        if state == "finished":
            return self._refuse(f"{run_dir.name} has finished; there is nothing to resume")
        before = int(RunDirectory(run_dir).read_run_info().get("processes") or 1)
        count = before if processes in (None, "") else _processes(processes)
        try:
            config = validate_config(RunDirectory(run_dir).read_config())
            placement, why = placement_for(config, count)
            self.jobs.launch(run_dir, config.train.mixed_precision, resume=True, placement=placement)
        except (UserError, OSError) as err:
            return self._refuse(str(err))
        self.jobs.queue.started(run_dir.name)  # a queued run resumed by hand is not started again
        change = (f"; it trained on {before} before (its log says what the change means for exactness)"
                  if count != before else "")
        return (f"Resumed `{run_dir.name}`{_placement_words(placement, why)}{change}.",
                gr.update(choices=self._run_names(), value=run_dir.name))

    def run_processes(self, name: str | None) -> Any:
        """The Processes field for the chosen run: the count it last ran on (Resume's default), when it has one."""
        run_dir = self._run_dir(name)
        before = RunDirectory(run_dir).read_run_info().get("processes") if run_dir else None
        return gr.update(value=int(before)) if before else gr.skip()

    def try_inputs(self, name: str | None) -> list[Any]:
        """Try it's image boxes for the chosen run: as many as its image-editing model takes a row
        (``model.input_images``), none for a run that generates from text, all three while no run's model can be
        read. A box that hides is emptied, so that Generate never sends a picture the page does not show. Then the
        whole-picture checkbox, shown with any box."""
        run_dir = self._run_dir(name)
        try:
            model = validate_config(RunDirectory(run_dir).read_config()).model if run_dir else None
            shown = input_images_a_row(model) if model else None
        except (UserError, OSError, ValueError):
            shown = None
        if shown is None:
            shown = len(TRY_INPUTS)
        return [*(gr.update(visible=True) if k < shown else gr.update(visible=False, value=None)
                  for k in range(len(TRY_INPUTS))), gr.update(visible=shown > 0)]

    def status(self, run: str = "") -> dict:
        """A run's state: ``run``, ``state`` (running, finished, failed, stopped, starting, interrupted, none),
        ``iteration``, ``total``, ``message``, ``active`` (a job of this app is running), ``active_run``,
        ``checkpoints`` and ``runs`` (all run names, newest first)."""
        job = self.jobs.active()
        run_dir = self._run_dir(run)
        result = {"run": None, "state": "none", "iteration": 0, "total": 0, "message": "", "active": job is not None,
                  "active_run": job.run_dir.name if job else None, "checkpoints": [], "runs": self._run_names()}
        if run_dir is not None:
            prog = live.progress(run_dir, job.started_at if job and job.run_dir == run_dir else None)
            result.update(run=run_dir.name, state=prog.state, iteration=prog.iteration, total=prog.total,
                          message=prog.message, checkpoints=live.checkpoints(run_dir))
        return result

    def _run_names(self) -> list[str]:
        return [p.name for p in self.jobs.runs()]

    # ----- live view -------------------------------------------------------------------------
    def refresh(self, selected: str, adapter_choice: str, seen: dict, queue_choice: str | None = None) -> tuple:
        """Everything the live view shows, for the selected run; the download button gives the adapter chosen in
        Publish's dropdown (``adapter_choice``), the Queue block keeps the queued run chosen in its dropdown
        (``queue_choice``). ``seen`` (per page) holds a signature of what the page already shows, so unchanged parts
        are skipped instead of sent again."""
        job = self.jobs.active()
        names = self._run_names()
        requested = selected  # the page's pick, before a refresh changes it
        active_name = job.run_dir.name if job else None
        if active_name and active_name != seen.get("active"):
            selected = active_name  # follow a job started elsewhere (another tab, before an app restart)
        if selected not in names:
            selected = active_name or (names[0] if names else None)
        seen = {**seen, "active": active_name}
        run_dir = self.jobs.root / selected if selected else None
        prog = live.progress(run_dir, job.started_at if job and job.run_dir == run_dir else None) if run_dir else None

        def changed(key: str, signature: Any, make, count: int = 1) -> list:
            if key in seen and seen[key] == signature:
                return [gr.skip()] * count
            seen[key] = signature
            made = make()
            return list(made) if count > 1 else [made]

        def mtime(path: Path | None) -> int | None:
            """A file's or a folder's modification time (a folder written by write_images is new each time)."""
            return path.stat().st_mtime_ns if path is not None and path.exists() else None

        def samples() -> tuple:
            first, first_images, last, last_images = live.eval_samples(run_dir) if run_dir else (None, [], None, [])
            return (gr.update(value=first_images, label=self._sample_label(first, "base model" if first == 0 else "")),
                    gr.update(value=last_images, label=self._sample_label(last, "latest")))

        def video():
            video, label = live.latest_video(run_dir) if run_dir else (None, "")
            return gr.update(value=video, label=label, visible=video is not None)

        run = RunDirectory(run_dir) if run_dir else None
        sample_iterations = run.sample_iterations() if run else []
        last_samples = run.samples_dir(sample_iterations[-1]) if sample_iterations else None
        resumable = job is None and prog is not None and prog.state in ("stopped", "failed", "interrupted")
        status, timing = live.status_words(run_dir, prog), live.timing_words(prog)
        bar = (prog.iteration, prog.total, prog.download, prog.message if prog.download else "") if prog else (0, 0)
        choices = tuple(live.adapter_choices(run_dir)) if run_dir else ((LATEST_ADAPTER, LATEST_ADAPTER),)
        chosen = adapter_choice if adapter_choice in [value for _, value in choices] else LATEST_ADAPTER
        adapter = live.chosen_adapter(run_dir, chosen) if run_dir else None
        adapter_file = adapter.file if adapter else None
        log = live.log_tail(run_dir) if run_dir else ""
        metrics_signature = (selected, mtime(run and run.metrics_file))
        buttons = (job is None, job is not None, resumable)
        queued = self.jobs.queue.names()
        queue_pick = queue_choice if queue_choice in queued else (queued[0] if queued else None)
        outputs = [
            *changed("runs", (tuple(names), selected), lambda: [_dropdown(names, selected, requested),
                                                                 gr.update(choices=names),
                                                                 gr.update(choices=["", *names])], count=3),
            *changed("status", status, lambda: status),
            *changed("timing", timing, lambda: timing),
            *changed("doctor", (selected, mtime(run and run.doctor_file)),
                     lambda: live.doctor_words(run_dir) if run_dir else ""),
            *changed("bar", bar, lambda: live.progress_bar(*bar)),
            _judge_plot(run_dir, seen, metrics_signature),
            _spread_plot(run_dir, seen, metrics_signature),
            *changed("metrics", metrics_signature, lambda: _curves(run_dir), count=3),
            *changed("samples", (selected, tuple(sample_iterations), mtime(last_samples)), samples, count=2),
            *changed("video", (selected, tuple(sample_iterations), mtime(last_samples)), video),
            *changed("grids", (selected, tuple(sample_iterations), mtime(last_samples)),
                     lambda: live.eval_grids(run_dir) if run_dir else []),
            *changed("rollouts", (selected, mtime(run and run.rollouts_dir)),
                     lambda: live.captioned(run.rollouts()) if run else []),
            *changed("log", log, lambda: log),
            *changed("download", (selected, str(adapter_file), mtime(adapter_file)),
                     lambda: gr.update(value=live.download_file(adapter),
                                       label=live.download_label(adapter), interactive=adapter is not None)),
            *changed("adapters", choices, lambda: _dropdown(list(choices), chosen, adapter_choice)),
            *changed("buttons", buttons, lambda: [gr.update(interactive=b) for b in buttons], count=3),
            *changed("queue", (tuple(queued), queue_pick),
                     lambda: [live.queue_words(queued), _dropdown(queued, queue_pick, queue_choice)], count=2),
        ]
        return (*outputs, seen)

    # ----- compare runs --------------------------------------------------------------------------
    def _compared(self, names: list[str] | None):
        """The chosen runs' evals (:func:`jagg_core.compare.read_runs`), or the one-line hint why there is nothing
        to compare."""
        from jagg_core import compare
        paths = [path for path in (self.jobs.run_dir(name) for name in names or []) if path is not None]
        if len(paths) < 2:
            return None, COMPARE_HINT
        try:
            return compare.read_runs(paths), ""
        except UserError as err:
            return None, f"**Cannot compare:** {err}"

    def compare(self, names: list[str] | None, x_axis: str, metric: str | None) -> tuple:
        """The Compare section for the runs ``names``: (hint, curves of ``metric`` against ``x_axis``, the table, the
        metric choices, the common eval iterations, the grids of the last of them side by side)."""
        from jagg_core import compare
        runs, hint = self._compared(names)
        if runs is None:
            return (hint, gr.update(value=None), "", gr.skip(), gr.update(choices=[], value=None), [])
        points = compare.curves(runs)
        metrics_seen = list(dict.fromkeys(point["metric"] for point in points))
        metric = metric if metric in metrics_seen else metrics_seen[0]
        x = "minutes" if x_axis == COMPARE_MINUTES else "iteration"
        frame = pd.DataFrame([p for p in points if p["metric"] == metric],
                             columns=["run", "metric", "iteration", "minutes", "value"]).astype(
            {"run": "str", "iteration": "int64", "minutes": "float64", "value": "float64"})
        shared = compare.common_iterations(runs)
        last = shared[-1] if shared else None
        plot = gr.update(value=frame, x=x, x_title=x_axis, y_title=metric, color_map=_colors(r.name for r in runs))
        return ("", plot,
                compare.table(runs), gr.update(choices=metrics_seen, value=metric),
                gr.update(choices=shared, value=last), self.compare_grids(names, last))

    def compare_grids(self, names: list[str] | None, iteration: int | None) -> list[tuple[str, str]]:
        """The chosen runs' eval grids of ``iteration``, side by side; none without a common iteration."""
        from jagg_core import compare
        runs, _ = self._compared(names)
        if runs is None or iteration is None:
            return []
        try:
            return compare.grids_at(runs, int(iteration))
        except UserError:
            return []

    @staticmethod
    def _sample_label(iteration: int | None, what: str) -> str:
        if iteration is None:
            return "Eval samples: later iterations appear here"
        return f"Iteration {iteration}" + (f" ({what})" if what else "")

    # ----- push ------------------------------------------------------------------------------
    def card(self, run: str, checkpoint: str, repo_id: str) -> str:
        """The model card a push of the run's adapter chosen (with the page's evaluation of it, if any) would
        upload to ``repo_id`` (empty: ``your-name/RUN``), as :func:`~app.live.card_preview` shows it."""
        run_dir = self._run_dir(run)
        if run_dir is None:
            return "**No model card:** choose a run first."
        repo = (repo_id or "").strip() or f"your-name/{run_dir.name}"
        try:
            files = hub.push_files(run_dir, repo, live.adapter_name(checkpoint),
                                   self.evaluation_of(run_dir, checkpoint))
        except UserError as err:
            return f"**No model card:** {err}"
        return live.card_preview(files)

    def push(self, run: str, checkpoint: str, repo_id: str, visibility: str, token: str,
             oauth_token: gr.OAuthToken | None = None, profile: gr.OAuthProfile | None = None) -> str:
        """Push the run's adapter (or a checkpoint) to the Hub, with the page's evaluation of it if there is one
        (:meth:`evaluation_of`); the token is the field's, else the signed-in user's, else HF_TOKEN / ``hf auth
        login``."""
        if refused := _refusal(profile):
            return f"**Not pushed:** {refused}"
        run_dir = self._run_dir(run)
        if run_dir is None:
            return "**Not pushed:** choose a run first."
        token = (token or "").strip() or (oauth_token.token if oauth_token else None)
        evaluation = self.evaluation_of(run_dir, checkpoint)
        try:
            url = hub.push_run(run_dir, (repo_id or "").strip(), private=visibility == PRIVATE,
                               checkpoint=live.adapter_name(checkpoint), token=token, evaluation=evaluation)
        except UserError as err:
            return f"**Not pushed:** {err}"
        return f"**Pushed:** [{url}]({url})" + (", with its evaluation made here" if evaluation else "")


def build_app(root: Path | None = None) -> gr.Blocks:
    """The JAGG Studio page for the runs under ``root`` (default :func:`~app.jobs.runs_root`)."""
    studio = Studio(root or runs_root())
    studio.jobs.run_queue_in_background()  # queued runs start in turn when the machine frees, also after a restart
    defaults = preset_form(DEFAULT_PRESET)
    presets = list_presets()
    with gr.Blocks(title="JAGG Studio") as demo:
        gr.Markdown("# JAGG Studio\nFine-tune a LoRA adapter of an image, image-editing or video flow model on "
                    "rewards (GRPO with JAGG, DiffusionNFT or AWM), watch it learn, and publish it to the Hugging Face "
                    "Hub.", elem_id="title")
        with gr.Row(equal_height=False):
            # ----- 1. set-up ---------------------------------------------------------------
            with gr.Column(scale=2, min_width=380):
                gr.Markdown("## 1 · Set up")
                default_processes, most_processes = process_choices()
                with gr.Row():
                    hardware = gr.Markdown(hardware_words(), elem_id="hardware")
                    processes = gr.Number(default_processes, minimum=1, maximum=most_processes, precision=0,
                                          label="GPUs to use" if gpu_rows() else "Processes (CPU cores)",
                                          info=f"1 to {most_processes}; several: data parallel, or the transformer "
                                               "sharded (FSDP) when it does not fit one", elem_id="processes",
                                          scale=0, min_width=160)
                preset = gr.Dropdown(list(presets), value=DEFAULT_PRESET, label="Preset", elem_id="preset",
                                     info="fills every field below")
                preset_info = gr.Markdown(presets.get(DEFAULT_PRESET, ""), elem_id="preset-info")
                with gr.Row():
                    name = gr.Textbox(defaults.name, label="Run name", elem_id="run-name")
                    model = gr.Dropdown(model_choices(), value=defaults.model, label="Base model",
                                        allow_custom_value=True, elem_id="model",
                                        info="pick one, or type a Hub id (owner/name) or a local folder")
                rewards = gr.Dropdown(available_rewards(), value=defaults.rewards, multiselect=True,
                                      label="Rewards", elem_id="rewards")
                reward_about = gr.Markdown(reward_words(defaults.rewards), elem_id="reward-about")
                weights = gr.Dataframe(defaults.weights, headers=["reward", "weight"], datatype=["str", "number"],
                                       type="array", static_columns=[0], label="Reward weights",
                                       elem_id="reward-weights", interactive=True)
                prompt_mode = gr.Radio(list(PROMPT_MODES), value=PROMPTS_BUILTIN, label="Prompts",
                                       elem_id="prompt-mode")
                prompt_set = gr.Dropdown(builtin_prompt_sets(), value=defaults.prompt_set, allow_custom_value=True,
                                         label="Prompt set", elem_id="prompt-set",
                                         info="built-in, or type hf://DATASET[:COLUMN], or for an editing model "
                                              "an image folder with prompts.csv (file, prompt) in $JAGG_PROMPT_DIRS")
                prompt_file = gr.File(label="Prompt file (.txt one per line, .csv/.jsonl with a 'prompt' column; for "
                                            "an editing model, a .zip of images with prompts.csv: file, prompt)",
                                      file_types=[*FILE_SUFFIXES, ARCHIVE_SUFFIX], type="filepath", visible=False,
                                      elem_id="prompt-file")
                prompt_text = gr.Textbox("", lines=8, max_lines=16, label="Prompts, one per line", visible=False,
                                         elem_id="prompt-text")
                eval_text = gr.Textbox("", lines=3, max_lines=12, label="Eval prompts of my own, one per line (optional)",
                                       info="the fixed-seed eval samples' prompts, kept out of training; empty: "
                                            "'Eval prompts' of the set are held out", elem_id="eval-text")
                widgets = _grid(MAIN_KNOBS, defaults.knobs, per_row=3)
                widgets |= _grid(ALGORITHM_KNOBS, defaults.knobs, per_row=3)
                with gr.Accordion("Advanced", open=False, elem_id="advanced"):
                    widgets |= _grid(ADVANCED_KNOBS, defaults.knobs, per_row=3)
                knobs = [widgets[knob.key] for knob in KNOBS]
                with gr.Row():
                    start = gr.Button("Start", variant="primary", elem_id="start-btn")
                    plan = gr.Button("Plan memory", elem_id="plan-btn")
                    stop = gr.Button("Stop", variant="stop", elem_id="stop-btn", interactive=False)
                    resume = gr.Button("Resume", elem_id="resume-btn", interactive=False)
                form_message = gr.Markdown(elem_id="form-message")
                memory_plan = gr.Markdown(elem_id="memory-plan")
                with gr.Accordion("Export the set-up: YAML for --config, or the command line", open=False,
                                  elem_id="export"):
                    export = gr.Button("Export", elem_id="export-btn")
                    export_yaml = gr.File(label="Run config (python -m jagg_core.run --config FILE)",
                                          elem_id="export-yaml", interactive=False)
                    export_cli = gr.Textbox(label="The same run from the command line", lines=3, interactive=False,
                                            buttons=["copy"], elem_id="export-cli")

            # ----- 2. live view and 3. push ------------------------------------------------------
            with gr.Column(scale=3, min_width=480):
                gr.Markdown("## 2 · Watch")
                with gr.Row():
                    run_select = gr.Dropdown(studio._run_names(), value=None, label="Run", elem_id="run-select",
                                             allow_custom_value=True,
                                             info="the active run, or any past run", scale=2)
                    run_status = gr.Markdown(live.status_words(None, None), elem_id="run-status")
                with gr.Row():
                    download = gr.DownloadButton("Download adapter", elem_id="download-btn", interactive=False,
                                                 size="sm")
                    delete = gr.Button("Delete run", variant="stop", elem_id="delete-btn", size="sm")
                run_message = gr.Markdown(elem_id="run-message")
                progress_bar = gr.HTML(live.progress_bar(0, 0), elem_id="progress")
                timing = gr.Markdown(elem_id="timing")
                doctor = gr.Markdown(elem_id="doctor")
                with gr.Accordion("Queue: runs waiting for the machine", open=True, elem_id="queue"):
                    queue_list = gr.Markdown(live.queue_words(studio.jobs.queue.names()), elem_id="queue-list")
                    with gr.Row():
                        queue_select = gr.Dropdown(studio.jobs.queue.names(), value=None, label="Queued run",
                                                   allow_custom_value=True, elem_id="queue-select", scale=2)
                        queue_up = gr.Button("Move up", size="sm", elem_id="queue-up-btn")
                        queue_down = gr.Button("Move down", size="sm", elem_id="queue-down-btn")
                        queue_remove = gr.Button("Remove", variant="stop", size="sm", elem_id="queue-remove-btn")
                    queue_message = gr.Markdown(elem_id="queue-message")
                with gr.Row():
                    reward_plot = gr.LinePlot(x="iteration", y="value", color="series", title="Reward", height=240,
                                              color_map=_colors(live.REWARD_SERIES.values()), elem_id="reward-plot")
                    loss_plot = gr.LinePlot(x="iteration", y="value", color="series", title="Loss", height=240,
                                            color_map=_colors(live.LOSS_SERIES.values()), elem_id="loss-plot")
                fidelity_plot = gr.ScatterPlot(x="iteration", y="value", color="series", height=200, visible=False,
                                               title="JAGG gradient fidelity (audited iterations, backward.audit_every)",
                                               color_map=_colors(live.FIDELITY_SERIES.values()),
                                               elem_id="fidelity-plot")
                judge_plot = gr.LinePlot(x="iteration", y="value", color="series", height=240, title=live.JUDGE_TITLE,
                                         visible=False, elem_id="judge-plot")
                spread_plot = gr.LinePlot(x="iteration", y="value", color="series", height=240,
                                          title=live.SPREAD_TITLE, visible=False, elem_id="spread-plot")
                gr.Markdown("**Fixed-seed eval samples** (held-out prompts): the base model beside the latest.")
                with gr.Row():
                    base_samples = gr.Gallery(label="Iteration 0 (base model)", columns=2, height=380,
                                              object_fit="contain", elem_id="base-samples")
                    latest_samples = gr.Gallery(label="Latest", columns=2, height=380, object_fit="contain",
                                                elem_id="latest-samples")
                latest_video = gr.Video(label="Latest eval video (video models)", interactive=False, height=300,
                                        loop=True, visible=False, elem_id="latest-video")
                eval_grids = gr.Gallery(label="Every eval, one captioned grid each (base model first): click to "
                                              "compare iterations", columns=4, height=300, object_fit="contain",
                                        elem_id="eval-grids")
                rollouts = gr.Gallery(label="Latest rollouts (training images, captioned with their reward)",
                                      columns=6, height=280, object_fit="contain", elem_id="rollouts")
                log = gr.Textbox(label="Log", lines=10, max_lines=10, autoscroll=True, interactive=False,
                                 elem_id="log")
                with gr.Accordion("Compare runs", open=False, elem_id="compare"):
                    with gr.Row():
                        compare_runs = gr.Dropdown(studio._run_names(), value=[], multiselect=True, label="Runs",
                                                   elem_id="compare-runs", scale=2)
                        compare_x = gr.Radio([COMPARE_ITERATIONS, COMPARE_MINUTES], value=COMPARE_ITERATIONS,
                                             label="X axis", elem_id="compare-x")
                        compare_metric = gr.Dropdown(["held-out reward"], value="held-out reward", label="Metric",
                                                     elem_id="compare-metric")
                    compare_hint = gr.Markdown(COMPARE_HINT, elem_id="compare-hint")
                    compare_plot = gr.LinePlot(x="iteration", y="value", color="run", height=260,
                                               elem_id="compare-plot")
                    compare_table = gr.Markdown(elem_id="compare-table")
                    compare_iteration = gr.Dropdown([], value=None, label="Eval iteration (every run has it)",
                                                    elem_id="compare-iteration")
                    compare_gallery = gr.Gallery(label="The runs' eval grids side by side", columns=2, height=360,
                                                 object_fit="contain", elem_id="compare-grids")

                gr.Markdown("## 3 · Publish")
                with gr.Row():
                    repo_id = gr.Textbox(label="Repo id", placeholder="your-name/my-lora", elem_id="push-repo")
                    checkpoint = gr.Dropdown([LATEST_ADAPTER], value=LATEST_ADAPTER, label="Adapter",
                                             allow_custom_value=True, elem_id="push-checkpoint")
                with gr.Row():
                    visibility = gr.Radio([PRIVATE, PUBLIC], value=PRIVATE, label="Visibility",
                                          elem_id="push-visibility")
                    token = gr.Textbox(label="Hugging Face token (write)", type="password", elem_id="push-token",
                                       info="empty: the signed-in account, else HF_TOKEN or `hf auth login`")
                with gr.Row():
                    if _oauth_available():
                        gr.LoginButton()
                    push = gr.Button("Push to the Hub", variant="primary", elem_id="push-btn")
                    preview = gr.Button("Preview the model card", elem_id="card-btn")
                push_result = gr.Markdown(elem_id="push-result")
                card_view = gr.Markdown(elem_id="card-view", max_height=600, container=True)

                gr.Markdown("## 4 · Try it\nA prompt of your own, with the adapter chosen above, beside the base model "
                            "(same seed, the run's sampler and size); for an image-editing model, an instruction and "
                            "the image it applies to (or the images, Picture 1 first); for image-to-video, a prompt "
                            "and the video's first frame.")
                with gr.Row():
                    try_prompt = gr.Textbox(label="Prompt", placeholder="a red circle on a blue background, top left",
                                            scale=3, elem_id="try-prompt")
                    try_seed = gr.Number(0, label="Seed", precision=0, scale=1, elem_id="try-seed")
                with gr.Row():  # as many as the run's model.input_images, 'Picture 1' first (Studio.try_inputs)
                    try_inputs = [gr.Image(label=label, type="filepath", sources=["upload"], height=200,
                                           elem_id=elem_id) for label, elem_id in TRY_INPUTS]
                try_whole = gr.Checkbox(True, label="Use the whole picture, in its shape", elem_id="try-whole",
                                        info="the run's sizes' areas in the picture's shape, as the pipelines edit; "
                                             "off: the run's own sizes, the picture centre-cropped to them, as its "
                                             "evals saw their inputs")
                generate = gr.Button("Generate", elem_id="generate-btn")
                try_message = gr.Markdown(elem_id="try-message")
                try_image = gr.Image(label="Base model | adapter", show_label=False, type="filepath",
                                     interactive=False, elem_id="try-image")  # a label would cover the prompt

                gr.Markdown("## 5 · Evaluate\nThe adapter chosen above against the base model (or another run's "
                            "adapter of the same base model) on many prompts, each from several noises (the same for "
                            "both), with the run's sampler and sizes, scored by its rewards and judges: means with "
                            "standard errors, and how often the adapter wins.")
                with gr.Row():
                    evaluate_set = gr.Dropdown(["", *builtin_prompt_sets()], value="", label="Prompt set",
                                               info="empty: the run's held-out eval prompts", elem_id="evaluate-set")
                    evaluate_limit = gr.Number(0, label="Prompts at most", precision=0, minimum=0,
                                               info="0: all of the set", elem_id="evaluate-limit")
                    evaluate_images = gr.Number(4, label="Images per prompt", precision=0, minimum=1,
                                                maximum=MAX_EVALUATION_IMAGES, elem_id="evaluate-images")
                with gr.Row():
                    evaluate_against = gr.Dropdown(["", *studio._run_names()], value="", label="Against",
                                                   info="empty: the base model; a run: the adapter chosen beside",
                                                   elem_id="evaluate-against")
                    evaluate_against_adapter = gr.Dropdown([(LATEST_ADAPTER, LATEST_ADAPTER)], value=LATEST_ADAPTER,
                                                           label="Its adapter", elem_id="evaluate-against-adapter",
                                                           info="of the run against: its latest, best or a "
                                                           "checkpoint's")
                evaluate = gr.Button("Evaluate", elem_id="evaluate-btn")
                evaluate_result = gr.Markdown(elem_id="evaluate-result")
                evaluate_image = gr.Image(label="First samples: base model | adapter", type="filepath",
                                          interactive=False, elem_id="evaluate-image")

        # ----- events ----------------------------------------------------------------------------
        form_inputs = [preset, name, model, rewards, weights, prompt_mode, prompt_set, prompt_file, prompt_text,
                       eval_text, *knobs]
        preset.input(studio.load_preset, preset,
                      [preset_info, name, model, rewards, weights, prompt_mode, prompt_set, *knobs],
                      api_name="load_preset")
        rewards.change(weight_rows, [rewards, weights], weights, api_visibility="private")
        rewards.change(reward_words, rewards, reward_about, api_visibility="private")
        widgets["train.algorithm"].change(algorithm_chosen, widgets["train.algorithm"], knobs,
                                          api_visibility="private")
        prompt_mode.change(studio.prompt_mode_changed, [prompt_mode, prompt_set, prompt_text],
                           [prompt_set, prompt_file, prompt_text], api_visibility="private")
        start.click(_named(studio.start, START_PARAMS), [*form_inputs, processes], [form_message, run_select],
                    api_name="start")
        plan.click(studio.plan, [*form_inputs, processes], memory_plan, api_name="plan")
        export.click(studio.export, form_inputs, [export_yaml, export_cli], api_name="export")
        delete.click(studio.delete, run_select, [run_message, run_select], js=CONFIRM_DELETE, api_name="delete")
        stop.click(studio.stop, None, form_message, api_name="stop")
        resume.click(studio.resume, [run_select, processes], [form_message, run_select], api_name="resume")
        push.click(studio.push, [run_select, checkpoint, repo_id, visibility, token], push_result, api_name="push")
        preview.click(studio.card, [run_select, checkpoint, repo_id], card_view, api_name="card")
        generate.click(studio.generate, [run_select, checkpoint, try_prompt, try_seed, *try_inputs, try_whole],
                       [try_image, try_message],
                       api_name="generate")
        evaluate_against.change(studio.against_adapters, evaluate_against, evaluate_against_adapter,
                                api_visibility="private")
        evaluate.click(studio.evaluate, [run_select, checkpoint, evaluate_set, evaluate_limit, evaluate_images,
                                         evaluate_against, evaluate_against_adapter],
                       [evaluate_image, evaluate_result], api_name="evaluate")
        queue_outputs = [queue_message, queue_list, queue_select]
        queue_up.click(studio.queue_up, queue_select, queue_outputs, api_name="queue_up")
        queue_down.click(studio.queue_down, queue_select, queue_outputs, api_name="queue_down")
        queue_remove.click(studio.queue_remove, queue_select, queue_outputs, api_name="queue_remove")
        compare_inputs = [compare_runs, compare_x, compare_metric]
        for trigger in (compare_runs.input, compare_x.input, compare_metric.input):
            trigger(studio.compare, compare_inputs, [compare_hint, compare_plot, compare_table, compare_metric,
                                                     compare_iteration, compare_gallery], api_visibility="private")
        compare_iteration.input(studio.compare_grids, [compare_runs, compare_iteration], compare_gallery,
                                api_visibility="private")
        gr.api(studio.status, api_name="status")

        seen = gr.State({})
        live_inputs = [run_select, checkpoint, seen, queue_select]
        live_outputs = [run_select, compare_runs, evaluate_against, run_status, timing, doctor, progress_bar,
                        judge_plot, spread_plot, reward_plot, loss_plot, fidelity_plot, base_samples, latest_samples,
                        latest_video, eval_grids, rollouts, log, download, checkpoint, start, stop, resume, queue_list,
                        queue_select, seen]
        # What reads and writes `seen` runs one event at a time (LIVE_EVENTS): two at once would each read it, and the
        # later to finish would put back what the page no longer shows (a plot emptied, but marked drawn).
        live_events = {"concurrency_id": LIVE_EVENTS, "concurrency_limit": 1, "api_visibility": "private"}
        timer = gr.Timer(REFRESH_S)
        for trigger in (timer.tick, demo.load, checkpoint.input):  # the download follows the chosen adapter
            trigger(studio.refresh, live_inputs, live_outputs, show_progress="hidden", **live_events)
        run_select.input(_forget_shown, seen, seen, **live_events).then(
            studio.refresh, live_inputs, live_outputs, show_progress="hidden", **live_events)
        run_select.input(studio.run_processes, run_select, processes, api_visibility="private")
        for trigger in (run_select.change, demo.load):  # a run chosen, started or resumed, and the page's first run
            trigger(studio.try_inputs, run_select, [*try_inputs, try_whole], api_visibility="private")
        demo.load(studio.active_form, None,
                  [name, model, rewards, weights, prompt_mode, prompt_set, prompt_text, eval_text, *knobs],
                  api_visibility="private")
        log.change(None, None, None, js=SCROLL_LOG_TO_END, api_visibility="private")
        gr.Timer(HARDWARE_REFRESH_S).tick(hardware_words, None, hardware, show_progress="hidden",
                                          api_visibility="private")
    return demo


def launch() -> None:
    """Serve the page on ``$GRADIO_SERVER_PORT`` (default 7860); run images are served from the runs root."""
    root = runs_root()
    build_app(root).launch(server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
                           allowed_paths=[str(root)], theme=gr.themes.Soft(), css=CSS)
