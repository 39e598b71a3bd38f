"""What a step measured under: the settings of the run configs it runs, kept in its record, so that a measurement
the product has since changed (a default, a preset, a kernel key) is known to be stale and measured again.

A step's settings are ``{label: {key: value}}``: each config it runs (:attr:`~.common.Step.configs`, e.g. one per
base of a tiny run) as the flat ``section.key`` values ``--set`` reads, less those that change no figure
(:data:`NOT_MEASURED`, and the keys of the algorithms a config does not run), on both sides of a comparison. A step
without configs (the device, the triage's fixed kernels) is never stale.
"""

from __future__ import annotations

from .common import CheckOptions, Step

#: changed keys named in a stale step's line, at most
SHOWN_CHANGES = 3
#: the keys and sections that change no figure: the run's name, text and directory, the Hub push, and the first
#: iteration's doctor (it leaves the run's losses and rewards as they are, and no step measures the first iteration's
#: memory: :func:`~jagg_core.memory_meter.measured_peak` measures the second)
NOT_MEASURED = ("name", "description", "output_dir", "hub", "train.doctor")


def measured_settings(settings: dict) -> dict:
    """The flat ``settings`` less the keys under :data:`NOT_MEASURED` and those only another algorithm than the
    settings' ``train.algorithm`` reads (:func:`~jagg_core.config.key_owner`: a run refuses them at anything but their
    defaults, so a change of such a default changes none of its figures)."""
    from ..config import key_owner
    algorithm = settings.get("train.algorithm", "grpo")
    return {key: value for key, value in settings.items()
            if not any(key == name or key.startswith(f"{name}.") for name in NOT_MEASURED)
            and key_owner(key) in (None, algorithm)}


def step_settings(step: Step, options: CheckOptions) -> dict[str, dict] | None:
    """The flat settings of each of the step's configs as the product resolves them today (None: it has none)."""
    if step.configs is None:
        return None
    from ..config import flat_keys
    return {label: measured_settings(flat_keys(config.model_dump(mode="json")))
            for label, config in step.configs(options).items()}


def changed_settings(kept: dict[str, dict] | None, current: dict[str, dict]) -> list[str]:
    """``label: key old -> new`` for each setting that differs, written as ``--set`` reads it (a config or key only on
    one side: ``-``; the label only when the step has several configs); one line when the measurement kept no
    settings (a record older than them). A key added to the config since, at its default, is no change: a new key's
    default keeps what the product did before it."""
    if kept is None:
        return ["measured before the check kept its settings"]
    from ..config import RunConfig, flat_keys, yaml_value
    defaults = flat_keys(RunConfig().model_dump(mode="json"))

    def shown(settings: dict, key: str) -> str:
        return yaml_value(settings[key]) if key in settings else "-"

    def added_at_its_default(before: dict, now: dict, key: str) -> bool:
        return key not in before and key in now and key in defaults and now[key] == defaults[key]

    changes, labels = [], sorted(set(kept) | set(current))
    for label in labels:
        before, now = measured_settings(kept.get(label, {})), current.get(label, {})
        prefix = f"{label}: " if len(labels) > 1 else ""
        changes += [f"{prefix}{key} {shown(before, key)} -> {shown(now, key)}"
                    for key in sorted(set(before) | set(now))
                    if shown(before, key) != shown(now, key) and not (label in kept
                                                                      and added_at_its_default(before, now, key))]
    return changes


def describe_changes(changes: list[str]) -> str:
    """The first :data:`SHOWN_CHANGES` of ``changes`` on one line, and how many more."""
    more = len(changes) - SHOWN_CHANGES
    return "; ".join(changes[:SHOWN_CHANGES]) + (f" and {more} more" if more > 0 else "")


class CurrentSettings(dict):
    """Each step's :func:`step_settings` by name, each made when first asked for: an order or a table needs those of
    the steps measured ok and of the steps run, and making a bench's config imports the model code (seconds)."""

    def __init__(self, steps: list[Step], options: CheckOptions):
        super().__init__()
        self.steps, self.options = {step.name: step for step in steps}, options

    def __missing__(self, name: str) -> dict | None:
        self[name] = step_settings(self.steps[name], self.options)
        return self[name]
