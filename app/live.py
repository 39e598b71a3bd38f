"""Readers of a run directory for the live view: state and progress in words, curves, images, log tail.

Everything here only reads ``RUN/`` (see :mod:`jagg_core.rundir`); files are replaced atomically by the trainer,
so a read never sees half a file. Missing files mean "not yet" and give empty values.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import os
import re
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from huggingface_hub import ModelCard
from PIL import Image

from jagg_core import metrics
from jagg_core.adapters import BEST, LATEST_LABEL, Adapter, best_words, choose_adapter
from jagg_core.config import term_names
from jagg_core.errors import UserError
from jagg_core.model_card import checklist_markdown
from jagg_core.run_queue import RunQueue
from jagg_core.rundir import ImageSet, RunDirectory, iteration_dirname
from jagg_core.tracking import dashboard_hints

from .form import with_labels

LOG_TAIL_BYTES = 64 * 1024
ETA_WINDOW = 5  # iterations averaged for the ETA
STARTING_PHASES = ("downloading", "loading", "base eval")  # the trainer's status phases before its first iteration


@dataclass(frozen=True)
class Progress:
    """Where a run stands. ``state`` is the trainer's (running, finished, failed, stopped), or ``starting``
    (launched: loading the model, sampling the base model), ``interrupted`` (says running but no process is left)
    or ``none``. ``message`` is the trainer's word on what it is doing (``base eval 16/64``) or why it ended."""

    state: str
    message: str
    iteration: int
    total: int
    elapsed_s: float | None
    eta_s: float | None
    phase_s: dict[str, float] | None = None  # mean seconds of each phase of time/* where it ran (eval: per eval)
    alarm: str = ""  # the newest reward-hacking alarm's line: status.json's, else the metrics'
    download: dict | None = None  # while the base model downloads: status.json's {"done", "total", "rate"} (bytes)


def progress(run_dir: Path, job_started_at: float | None = None) -> Progress:
    """The progress of ``run_dir``; ``job_started_at`` is when its live training process was launched (None if
    no process is running it). A status older than the launch is the previous job's."""
    run = RunDirectory(run_dir)
    status = run.read_status()
    state, message = status.get("state"), str(status.get("message") or "")
    if job_started_at is not None:
        current = status.get("updated_at", 0) >= job_started_at
        message = message if current else ""  # the previous job's
        if not current or (state == "running" and status.get("phase") in STARTING_PHASES):
            state = "starting"
    elif state == "running" and not run.trainer_alive():
        state = "interrupted"  # no live process holds the run's lock (a process started elsewhere would)
    elif state is None:
        state = "none"
    total = int(status.get("total_iterations") or run.configured_iterations())
    iteration = int(status.get("iteration") or 0)
    started, updated = status.get("started_at"), status.get("updated_at")
    elapsed = None
    if job_started_at is not None:
        elapsed = time.time() - job_started_at
    elif started:
        elapsed = (updated or started) - started
    eta = None
    rows = run.read_metrics()
    trained = [r for r in rows if r[metrics.ITERATION] > 0]
    if state == "running":
        times = [metrics.seconds(r) for r in trained[-ETA_WINDOW:]]
        if times:
            eta = max(0.0, (total - iteration) * sum(times) / len(times))
    alarms = [r[metrics.HACKING_ALARM] for r in rows if r.get(metrics.HACKING_ALARM)]
    alarm = str(status.get("alarm") or (alarms[-1] if alarms else ""))
    download = status.get("download") if status.get("phase") == "downloading" and state == "starting" else None
    download = download if isinstance(download, dict) and download.get("total") else None
    return Progress(state, message, iteration, total, elapsed, eta, phase_seconds(trained), alarm, download)


def phase_seconds(rows: list[dict]) -> dict[str, float]:
    """Mean seconds of each phase (``time/rollout_s`` ...) over the rows where it ran, by phase name."""
    means = {}
    for key in metrics.PHASE_TIMES:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            means[key.removeprefix("time/").removesuffix("_s")] = sum(values) / len(values)
    return means


def duration(seconds: float | None) -> str:
    """``75`` -> ``1 min 15 s``."""
    if seconds is None:
        return "–"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


STATE_WORDS = {
    "none": "**Not started.**",
    "queued": "**Queued.** It starts when the machine frees.",
    "starting": "**Starting…**",
    "running": "**Training…**",
    "finished": "**Finished.** The adapter is ready to push.",
    "stopped": "**Stopped.** Resume continues from the last checkpoint.",
    "failed": "**Failed.**",
    "interrupted": "**Interrupted:** the training process is gone. Resume continues from the last checkpoint.",
}


def status_words(run_dir: Path | None, prog: Progress | None) -> str:
    """The run's state in words (Markdown), with the trainer's message when it explains a failure, and the
    reward-hacking alarm's line in bold when it fired."""
    if run_dir is None or prog is None:
        return "**No run yet.** Set up a run and press **Start**."
    state = STATE_WORDS.get(prog.state, prog.state)
    if prog.state == "queued":
        position = RunQueue(run_dir.parent).position(run_dir.name)
        state = f"**Queued (position {position}).** It starts when the machine frees." if position else state
    words = f"{state}  \nRun `{run_dir.name}`"
    if prog.alarm:
        words += f"  \n**⚠️ {prog.alarm}**"
    if prog.state in ("starting", "running"):
        words += f"  \nNow: {prog.message or 'launching the training process'}"
    if prog.state == "failed" and prog.message:
        words += f"  \n**Reason:** {prog.message}"
    run = RunDirectory(run_dir)
    try:
        hints = dashboard_hints(run.read_config(), run)
    except UserError:
        hints = []
    return words + "".join(f"  \n{hint}" for hint in hints)


def timing_words(prog: Progress | None) -> str:
    """``Iteration 3 / 10 · elapsed 1 min 02 s · about 2 min left``, and below it the mean seconds of each phase
    of an iteration (``rollout 0.81 s, train 0.22 s, eval 4.10 s (each eval)``)."""
    if prog is None:
        return ""
    parts = [f"Iteration **{prog.iteration} / {prog.total}**", f"elapsed {duration(prog.elapsed_s)}"]
    if prog.eta_s is not None:
        parts.append(f"about {duration(prog.eta_s)} left")
    words = " · ".join(parts)
    if prog.phase_s:
        phases = [f"{name} {seconds:.2f} s" + (" (each eval)" if name == "eval" else "")
                  for name, seconds in prog.phase_s.items()]
        words += "  \nAn iteration costs " + ", ".join(phases)
    return words


# metric key -> series label, for the reward plot, the loss plot and the fidelity plot (the audits' cosines)
REWARD_SERIES = {metrics.REWARD_MEAN: "rollout reward", metrics.EVAL_REWARD_MEAN: "eval reward (fixed seeds)"}
LOSS_SERIES = {metrics.LOSS: "loss", metrics.KL: "KL"}
FIDELITY_SERIES = {metrics.JAGG_GRAD_COSINE: "grad cosine vs exact"}


JUDGE_TITLE = "Eval reward and judges, change since the base model"
EVAL_CHANGE = "eval reward"


def _frame(points: list[tuple[int, float, str]], labels) -> pd.DataFrame:
    """A plot's long-format frame ``(iteration, value, series)`` of ``points``. The page's plot fixes its axis types
    and series from the first frame it gets, so every frame is typed and names every series of ``labels`` (one not
    measured yet gets a NaN point, which is not drawn)."""
    present = {label for _, _, label in points}
    points = points + [(0, float("nan"), label) for label in labels if label not in present]
    return pd.DataFrame(points, columns=["iteration", "value", "series"]).astype(
        {"iteration": "int64", "value": "float64", "series": "str"})


def curves(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Long-format frames ``(iteration, value, series)`` for the reward plot, the loss plot and the fidelity plot
    (``backward.audit_every``: a point per audited iteration)."""
    rows = RunDirectory(run_dir).read_metrics()

    def frame(series: dict[str, str]) -> pd.DataFrame:
        return _frame([(row[metrics.ITERATION], float(row[key]), label) for row in rows
                       for key, label in series.items() if isinstance(row.get(key), (int, float))], series.values())

    return frame(REWARD_SERIES), frame(LOSS_SERIES), frame(FIDELITY_SERIES)


def fidelity_limits(run_dir: Path, fidelity: pd.DataFrame) -> tuple[list[float], list[float]]:
    """The fidelity plot's axes: iterations over the whole run (``train.iterations``, or the last audited where the
    config cannot be read), cosines from 0 (or the lowest below it) to 1, each with a margin so that a point at an
    end is drawn whole."""
    try:
        total = float((RunDirectory(run_dir).read_config().get("train") or {}).get("iterations") or 0)
    except UserError:
        total = 0.0
    audited = fidelity.dropna()
    total = max(total, float(audited["iteration"].max()) if not audited.empty else 1.0)
    lowest = min(0.0, float(audited["value"].min()) if not audited.empty else 0.0)
    return [0.0, total + max(0.5, 0.03 * total)], [lowest - 0.05, 1.05]


def judges(run_dir: Path) -> list[str]:
    """The run's judges (``eval.judges``, named as in the metrics) and any other judge its metrics hold."""
    run = RunDirectory(run_dir)
    try:
        configured = (run.read_config().get("eval") or {}).get("judges") or []
    except UserError:
        configured = []
    names = term_names([str(judge.get("name")) for judge in configured])
    return list(dict.fromkeys([*names, *metrics.judge_names(run.read_metrics())]))


def judge_curve(run_dir: Path) -> pd.DataFrame:
    """The long-format frame of the judges plot: the held-out reward's eval mean (series ``eval reward``) and each
    judge's (``judge NAME``) against iteration, each as its change since its first eval (the base model's), since
    their scales differ. Every judge of the run is a series from the start (:func:`judges`)."""
    rows = RunDirectory(run_dir).read_metrics()
    series = {metrics.EVAL_REWARD_MEAN: EVAL_CHANGE, **{metrics.judge_key(name): f"judge {name}"
                                                        for name in judges(run_dir)}}
    points = []
    for key, label in series.items():
        scored = [row for row in rows if isinstance(row.get(key), (int, float))]
        points += [(row[metrics.ITERATION], float(row[key]) - float(scored[0][key]), label) for row in scored]
    return _frame(points, series.values())


SPREAD_TITLE = "Each reward's signal: its weighted spread within groups"


def spread_curve(run_dir: Path) -> pd.DataFrame:
    """The long-format frame of the rewards' signal plot: each reward's ``reward_spread/NAME`` (its weighted score's
    standard deviation within a group, :func:`jagg_core.grpo.group_spread`) against iteration, a series per reward."""
    rows = RunDirectory(run_dir).read_metrics()
    prefix = metrics.reward_spread("")
    names = list(dict.fromkeys(key.removeprefix(prefix) for row in rows for key in row if key.startswith(prefix)))
    return _frame([(row[metrics.ITERATION], float(row[metrics.reward_spread(name)]), name) for row in rows
                   for name in names if isinstance(row.get(metrics.reward_spread(name)), (int, float))], names)


def doctor_words(run_dir: Path) -> str:
    """The first iteration's checklist (``RUN/doctor.json``) as Markdown (:func:`~jagg_core.model_card.
    checklist_markdown`), its fixes naming the page's fields where they name their config keys; empty before the
    first iteration."""
    report = RunDirectory(run_dir).read_doctor()
    return "\n".join(checklist_markdown(report, with_labels)) if report else ""


def captioned(images: ImageSet | None) -> list[tuple[str, str]]:
    """``(png path, caption)`` of an image set: the prompt, and its reward when known."""
    if images is None:
        return []
    captions = []
    for i, (png, prompt) in enumerate(zip(images.images, images.prompts)):
        reward = images.rewards[i] if i < len(images.rewards) else None
        captions.append((str(png), prompt + (f"  ·  reward {reward:.3f}" if isinstance(reward, (int, float)) else "")))
    return captions


def eval_samples(run_dir: Path) -> tuple[int | None, list, int | None, list]:
    """``(first iteration, its images, latest iteration, its images)`` of the eval samples."""
    run = RunDirectory(run_dir)
    found = run.sample_iterations()
    if not found:
        return None, [], None, []
    first, last = found[0], found[-1]
    latest = captioned(run.samples(last)) if last != first else []
    return first, captioned(run.samples(first)), (last if last != first else None), latest


def latest_video(run_dir: Path) -> tuple[str | None, str]:
    """``(MP4 path, label)`` of the latest eval's first video (a video model's run); ``(None, label)`` for an image
    run or before the first eval."""
    run = RunDirectory(run_dir)
    found = run.sample_iterations()
    samples = run.samples(found[-1]) if found else None
    if samples is None or not samples.videos:
        return None, "Latest eval video (video models)"
    what = "base model" if samples.iteration == 0 else f"iteration {samples.iteration}"
    return str(samples.videos[0]), f"Latest eval video ({what}): {samples.prompts[0]}"


def eval_grids(run_dir: Path) -> list[tuple[str, str]]:
    """``(grid png, caption)`` of every eval that has a captioned grid, oldest first: the run's timeline."""
    run = RunDirectory(run_dir)
    rewards = {row[metrics.ITERATION]: row[metrics.EVAL_REWARD_MEAN] for row in run.read_metrics()
               if isinstance(row.get(metrics.EVAL_REWARD_MEAN), (int, float))}
    timeline = []
    for iteration in run.sample_iterations():
        if run.grid_file(iteration).is_file():
            caption = "base model" if iteration == 0 else f"iteration {iteration}"
            reward = f" · eval reward {rewards[iteration]:.3f}" if iteration in rewards else ""
            timeline.append((str(run.grid_file(iteration)), caption + reward))
    return timeline


def queue_words(names: list[str]) -> str:
    """The Queue block's list: each queued run with its position, the next to start first."""
    if not names:
        return "No run is queued. **Start** while a run trains queues the new run."
    return "\n".join(f"{position}. `{name}`" for position, name in enumerate(names, 1))


def progress_bar(iteration: int, total: int, download: dict | None = None, message: str = "") -> str:
    """The run's progress as a read-only HTML bar with ``iteration / total``; while the base model downloads
    (``download``: status.json's ``{"done", "total", "rate"}``), the download's bytes done of total with the trainer's
    ``message`` ("downloading OWNER/NAME: 3.2 of 23.8 GB, 41 MB/s, about 8 min left")."""
    if download:
        done, whole = int(download.get("done") or 0), max(int(download.get("total") or 0), 1)
        words = html.escape(message or f"downloading the base model: {100 * done // whole}%")
        return (f'<div class="run-progress"><progress value="{done}" max="{whole}"></progress>'
                f"<span>{words}</span></div>")
    return (f'<div class="run-progress"><progress value="{iteration}" max="{max(total, 1)}"></progress>'
            f"<span>{iteration} / {total} iterations</span></div>")


def log_tail(run_dir: Path, lines: int = 40) -> str:
    """The last lines of the job's output, progress-bar redraws folded."""
    text = RunDirectory(run_dir).log_tail(LOG_TAIL_BYTES)
    shown = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
    return "\n".join([line for line in shown if line][-lines:])


def checkpoints(run_dir: Path) -> list[str]:
    """The run's complete checkpoints, newest first (``iter_000010`` ...)."""
    return [iteration_dirname(i) for i in reversed(RunDirectory(run_dir).checkpoint_iterations())]


def adapter_choices(run_dir: Path) -> list[tuple[str, str]]:
    """Publish's adapters as ``(label, value)``: the latest adapter, the best when the run has one (labelled with
    its iteration and metric, e.g. ``best (iteration 40, judge shapes_fidelity 0.912)``, its value ``best``), then
    each checkpoint, newest first."""
    best = RunDirectory(run_dir).read_best()
    choices = [(LATEST_LABEL, LATEST_LABEL)]
    if best:
        choices.append((f"best ({best_words(best)})", BEST))
    return choices + [(name, name) for name in checkpoints(run_dir)]


def adapter_name(choice: str | None) -> str | None:
    """The adapter of Publish's dropdown value for a push, a try or a download: None for the latest, else ``best``
    or ``iter_N``."""
    return None if choice in (None, "", LATEST_LABEL) else choice


def chosen_adapter(run_dir: Path, choice: str | None) -> Adapter | None:
    """The adapter chosen in Publish's dropdown; None while the run has none of that kind."""
    try:
        return choose_adapter(run_dir, adapter_name(choice))
    except UserError:
        return None


def download_file(adapter: Adapter | None) -> Path | None:
    """What the download button gives: the adapter's file, or, for an adapter of two files (both experts of a
    two-expert model), a zip of them (``latest_adapter.zip``, ``best_adapter.zip``, ``iter_000120.zip``). The zip has
    one place per adapter folder in the temporary directory, replaced atomically, and is written again only when the
    adapter is newer: the pages refresh it at every checkpoint, and an adapter is up to hundreds of MB."""
    if adapter is None or len(files := adapter.files) == 1:
        return adapter.file if adapter else None
    folder = Path(tempfile.gettempdir()) / "jagg-adapters" / hashlib.sha256(
        str(adapter.file.parent.resolve()).encode()).hexdigest()[:16]
    archive = folder / f"{adapter.label.replace(' ', '_')}.zip"
    if archive.is_file() and archive.stat().st_mtime >= max(file.stat().st_mtime for file in files):
        return archive
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{archive.name}.{os.getpid()}.tmp"
    with zipfile.ZipFile(tmp, "w") as bundle:  # stored: safetensors' weights do not compress
        for file in files:
            bundle.write(file, file.name)
    os.replace(tmp, archive)
    return archive


def download_label(adapter: Adapter | None) -> str:
    """The download button's words: ``Download adapter`` (the latest), ``Download best adapter``, ``Download
    iter_000120``."""
    return "Download adapter" if adapter is None or adapter.choice is None else f"Download {adapter.label}"


#: a Markdown image of the model card, ``![alt](path)``, and an HTML video, ``<video src="path" ...></video>``
CARD_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
CARD_VIDEO = re.compile(r'<video src="([^"]+)"[^>]*></video>')
#: the widest a card's image is shown in the page's preview, in pixels
PREVIEW_WIDTH = 960


def preview_image(content: bytes | Path) -> str:
    """An image of the card (its PNG bytes or file) as a ``data:`` URI the page's Markdown shows: at most
    :data:`PREVIEW_WIDTH` px wide and JPEG-encoded, so that a card of 512 px grids stays a few hundred kB."""
    with Image.open(io.BytesIO(content) if isinstance(content, bytes) else content) as image:
        image = image.convert("RGB")
    image.thumbnail((PREVIEW_WIDTH, image.height))
    jpeg = io.BytesIO()
    image.save(jpeg, "JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(jpeg.getvalue()).decode()


def card_preview(files: dict[str, bytes | Path]) -> str:
    """The model card of a push's ``files`` (:func:`~jagg_core.model_card.publish_files`) as the page shows it
    before the push: its Hub metadata in a line, then its Markdown with its images (:func:`preview_image`); each
    video is named by its path in the repo (the page's Watch plays them)."""
    card = ModelCard(files["README.md"].decode())
    data = card.data
    tags = ", ".join(f"`{tag}`" for tag in data.tags or [])
    base = f"base model `{data.base_model}` · " if data.base_model else ""
    body = CARD_IMAGE.sub(lambda match: f"![{match[1]}]({preview_image(files[match[2]])})" if match[2] in files
                          else f"*[image: `{match[2]}`]*", card.text)
    body = CARD_VIDEO.sub(lambda match: f"*[video: `{match[1]}`]*", body)
    return f"**Hub metadata:** {base}`{data.pipeline_tag}` · tags {tags}\n\n---\n{body}".rstrip()
