"""What earlier checks measured, and what to run next.

The ledger is every ``*.json`` of a folder (``docs/gpu/``, kept in the repo): a file holds ``date``, ``options``
and ``rows`` (each with its ``step`` and ``status``): the check writes one file per step it runs
(``STEP.json``, its log beside it as ``STEP.log``); the first check's two files hold several steps each. A step's
last outcome is that of its rows in the newest file that has it (:func:`step_status`); rows skipped because a
budget was spent do not count (the step was not run). Files of the other size (``--reduced`` or not) are ignored.

:func:`plan_order` then puts first what is not yet known: the device (seconds; it says which machine this is),
the triage's cases not yet run or cut short by their cap (they diagnose the failures; a case that failed or
crashed is a finding, as much as one that passed, and runs again only when asked for by name, e.g. under another
torch or cuDNN), the other steps whose last outcome was not ``ok``
(each a failure a user can meet: whether its fix holds is known first; those whose process or CUDA context died
before the others, the failures the triage is about), then the steps never measured, then those measured ok under
other settings than the product's today (:mod:`.settings`: a default, a preset or a kernel key changed since; or
measured before records kept their settings), each group in the order of registration (:func:`~.steps.all_steps`).
Steps measured ok under today's settings are not run again unless asked for by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .common import NOT_OK, CheckOptions, Step
from .settings import changed_settings, describe_changes

BUDGET_SKIP = "budget"
#: a triage case's outcomes that answer its question (its kernel ran and passed, raised, or killed the process);
#: ``timed out`` answers nothing
TRIAGE_FINDINGS = ("ok", "failed", "crashed")


@dataclass(frozen=True)
class Outcome:
    """A step's last outcome in the ledger."""

    status: str
    date: str
    rows: list[dict]
    #: the step's seconds, its process start included
    seconds: float | None
    #: the settings it was measured under (:func:`~.settings.step_settings`; None: not kept, or it has none)
    settings: dict[str, dict] | None = None


def stale_changes(outcome: Outcome, settings: dict[str, dict | None], name: str) -> list[str]:
    """How the settings of step ``name``'s ``ok`` outcome differ from the product's today (``settings``, asked only
    for an ok outcome; empty: the same, or a step without configs, or not ok: a step not ok runs again anyway)."""
    if outcome.status != "ok" or settings[name] is None:
        return []
    return changed_settings(outcome.settings, settings[name])


def cuda_failure(outcome: Outcome) -> bool:
    """Whether the step's process died (``crashed``) or it raised a CUDA error."""
    return outcome.status == "crashed" or any("CUDA" in row.get("reason", "") for row in outcome.rows)


def step_status(rows: list[dict]) -> str | None:
    """A step's status from its rows: the first of :data:`~.common.NOT_OK` among them, else ``ok`` (rows skipped
    on this device count as done), or None where every row is a budget skip (never run)."""
    ran = [row for row in rows if not (row["status"] == "skipped" and BUDGET_SKIP in row.get("reason", ""))]
    if not ran:
        return None
    return next((status for status in NOT_OK if any(row["status"] == status for row in ran)), "ok")


def read_ledger(folders: list[Path], options: CheckOptions) -> dict[str, Outcome]:
    """Each step's newest outcome in the ``*.json`` files of ``folders`` (those of the same ``reduced``)."""
    outcomes: dict[str, Outcome] = {}
    for path in sorted(p for folder in folders if folder.is_dir() for p in folder.glob("*.json")):
        record = json.loads(path.read_text())
        if "rows" not in record or record.get("options", {}).get("reduced", False) != options.reduced:
            continue
        by_step: dict[str, list[dict]] = {}
        for row in record["rows"]:
            by_step.setdefault(row["step"], []).append(row)
        for step, rows in by_step.items():
            status = step_status(rows)
            earlier = outcomes.get(step)
            if status and (earlier is None or record["date"] >= earlier.date):
                seconds = record.get("seconds") if "step" in record else rows[0].get("step_s")
                outcomes[step] = Outcome(status, record["date"], rows, seconds, record.get("settings"))
    return outcomes


def plan_order(steps: list[Step], ledger: dict[str, Outcome], settings: dict[str, dict | None],
               only: list[str] | None = None) -> list[Step]:
    """The steps to run, in order: ``only`` as given, else the device, the triage's cases not yet answered, the
    other last failed, the never measured, the stale (see the module docstring); ``settings``: each step's today
    (:func:`~.settings.step_settings`)."""
    if only:
        return [next(step for step in steps if step.name == name) for name in only]

    def group(step: Step) -> int:
        if step.table == "triage":
            return 0
        if step.name not in ledger:
            return 3
        if ledger[step.name].status == "ok":
            return 4
        return 1 if cuda_failure(ledger[step.name]) else 2

    def done(step: Step) -> bool:
        last = ledger.get(step.name)
        if last is None:
            return False
        if step.table == "triage" and last.status in TRIAGE_FINDINGS:
            return True
        return last.status == "ok" and not stale_changes(last, settings, step.name)

    pending = [step for step in steps if step.name != "device" and not done(step)]
    return [step for step in steps if step.name == "device"] + sorted(pending, key=group)  # stable: registration


def describe_order(order: list[Step], ledger: dict[str, Outcome], settings: dict[str, dict | None],
                   options: CheckOptions) -> list[str]:
    """One line per step to run: why it runs (never measured, its last outcome and date, and what changed since
    an ok one) and its cap."""
    lines = []
    for step in order:
        last = ledger.get(step.name)
        why = f"last {last.status} on {last.date[:10]}" if last else "never measured"
        if last and (changes := stale_changes(last, settings, step.name)):
            why += f", stale: {describe_changes(changes)}"
        lines.append(f"{step.name}: {why}, cap {step.cap(options):.0f} s")
    return lines
