"""What the fixed-seed eval tells about a run beyond its training reward: judges, the reward-hacking alarm and the
best adapter.

* **Judges** (``eval.judges``) are rewards that score the eval samples only, never the rollouts, so training cannot
  optimize them: each judge's mean is ``eval/judge/NAME`` in ``metrics.jsonl``. A judge must differ from every
  training reward (another name, or the same reward with other options).
* **The alarm** (:class:`HackingAlarm`) watches, at every eval, the training reward's eval score and each judge's on
  the same fixed-seed samples. Over the last ``w = eval.hacking_window`` evals (from eval ``n - w`` to eval ``n``)
  it fires when the reward's eval mean rose at every eval and the judge's fell at every eval, and both changes are
  beyond the noise: with ``d_i`` the change of sample ``i``'s score from eval ``n - w`` to eval ``n``, and ``N``
  samples, ``|mean(d)| > z std(d) / sqrt(N)`` (``z = eval.hacking_z``; the samples are paired, the same prompts and
  seeds at every eval). It needs ``N >= 2``. ``train.on_hacking`` says whether it only warns or also stops the run.
* **The best adapter** (:class:`BestAdapter`): at every eval of the adapter, if ``eval.best_by`` (the training
  reward's eval mean, or a judge's) is higher than at every earlier eval, the adapter is copied to ``RUN/best``;
  its record (``best.json``: which iteration, metric and value, and why) is brought up to date at every eval.

The alarm's history and the best record are part of a checkpoint's training state, so a resumed run decides as an
uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import metrics
from .config import RunConfig, term_names
from .download import amount
from .errors import UserError
from .host import available_memory
from .rewards import CombinedReward, build_reward
from .rewards.catalog import check_reward_specs, reward_options
from .rewards.model_size import ScoringModelSize, scoring_model_size

if TYPE_CHECKING:
    import torch

#: the value of ``eval.best_by`` that means the training rewards' eval mean
BEST_BY_REWARD = "reward"


def check_judges(config: RunConfig) -> None:
    """Every judge names a known reward with valid options, and none equals a training reward (same name, same
    options): a one-line :class:`UserError` otherwise. Loads nothing."""
    try:
        check_reward_specs(config.eval.judges)
    except UserError as err:
        raise UserError(f"eval.judges: {err}") from None
    trained = {(spec.name, reward_options(spec.name, spec.options)) for spec in config.rewards}
    for judge in config.eval.judges:
        if (judge.name, reward_options(judge.name, judge.options)) in trained:
            raise UserError(f"eval.judges: judge '{judge.name}' is also a training reward: a judge must measure what "
                            "training does not optimize; choose another judge (e.g. shapes_fidelity, aesthetic, "
                            "hpsv2, clip_score, vqa_score) or give it other options")


def judges_device(config: RunConfig, device: torch.device | str) -> torch.device:
    """Where the judges' models run: the training ``device``, or the CPU with ``eval.judges_on_cpu``."""
    import torch
    return torch.device("cpu") if config.eval.judges_on_cpu else torch.device(device)


def cpu_judges(config: RunConfig) -> dict[str, ScoringModelSize]:
    """The judges whose models load into host memory (``eval.judges_on_cpu``) by name, each with its model's size
    (:func:`~jagg_core.rewards.model_size.scoring_model_size`); judges without a model left out."""
    if not config.eval.judges_on_cpu:
        return {}
    names = term_names([spec.name for spec in config.eval.judges])
    sizes = [scoring_model_size(spec.name, spec.options) for spec in config.eval.judges]
    return {name: size for name, size in zip(names, sizes) if size.params}


def check_judges_room(judges: dict[str, ScoringModelSize], processes: int = 1, beside: float = 0) -> None:
    """Refuse, in one line, judges on the CPU (:func:`cpu_judges`) whose models the host memory available cannot
    hold, in each of this machine's ``processes`` (each loads every judge), ``beside`` the bytes a process holds
    there too before they load (the plan's text-embedding cache)."""
    size = sum(judge.cpu_bytes for judge in judges.values())
    memory = available_memory()
    if not size or (size + beside) * processes <= memory:
        return
    each = f" in each of the {processes} processes" if processes > 1 else ""
    also = f" beside the text-embedding cache ({amount(beside)})" if beside else ""
    raise UserError(f"the judges on the CPU ({', '.join(judges)}; eval.judges_on_cpu) take {amount(size)} of host "
                    f"memory{each}{also}; this machine has {amount(memory)} available; set eval.judges_on_cpu=false "
                    "(they then run on the GPU) or remove the largest judge from eval.judges")


def build_judges(config: RunConfig, device: torch.device | str) -> CombinedReward | None:
    """The judges as one :class:`CombinedReward` whose parts are the judges by name (None when there are none), on
    :func:`judges_device`."""
    specs = config.eval.judges
    if not specs:
        return None
    judges = [build_reward(spec, judges_device(config, device)) for spec in specs]
    return CombinedReward(judges, [1.0] * len(judges), term_names([spec.name for spec in specs]),
                          config.sampling.reward_frames)


def load_judges(judges: CombinedReward, images: torch.Tensor, prompts: list[str]) -> None:
    """Score ``images`` once with every judge, so each loads its model now (at set-up, after the base model) and a
    judge that cannot load is a one-line :class:`UserError` before the base eval."""
    for name, judge in zip(judges.names, judges.rewards):
        single = CombinedReward([judge], [1.0], [name], judges.reward_frames)
        try:
            single(images, prompts)
        except UserError as err:
            raise UserError(f"judge '{name}' cannot score the eval samples: {err}") from None
        except Exception as err:  # a model that fails to download or load fails in many ways
            raise UserError(f"judge '{name}' failed to load ({type(err).__name__}: {str(err)[:200]}); fix its "
                            "options or remove it from eval.judges") from None


@dataclass
class EvalScores:
    """One eval's per-sample scores: the training reward (combined) and each judge's, on the same samples."""

    iteration: int
    reward: list[float]
    judges: dict[str, list[float]]


def mean_change(before: list[float], after: list[float]) -> tuple[float, float]:
    """``(mean(d), std(d) / sqrt(N))`` of the paired per-sample changes ``d = after - before`` (NaN when a score
    is: the alarm then stays silent)."""
    d = [b - a for a, b in zip(before, after)]
    mean = sum(d) / len(d)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))


class HackingAlarm:
    """The reward-hacking alarm (the module's rule) over the evals seen so far."""

    def __init__(self, window: int, z: float):
        self.window, self.z = window, z
        self.history: list[EvalScores] = []

    def observe(self, scores: EvalScores) -> str | None:
        """Add an eval; the alarm's one line when it fires now (the judge that fell the most, in allowances)."""
        self.history.append(scores)
        if len(self.history) <= self.window or len(scores.reward) < 2:
            return None
        span = self.history[-self.window - 1:]
        first, last = span[0], span[-1]
        rise, rise_se = mean_change(first.reward, last.reward)
        if not (self._monotone(s.reward for s in span) > 0 and rise > self.z * rise_se):
            return None
        alarms = []
        for name in last.judges:
            if name not in first.judges or self._monotone(s.judges.get(name, []) for s in span) >= 0:
                continue
            fall, fall_se = mean_change(first.judges[name], last.judges[name])
            allowance = self.z * fall_se
            if -fall > allowance:
                alarms.append((-fall / max(allowance, 1e-12), name, fall, allowance))
        if not alarms:
            return None
        _, name, fall, allowance = max(alarms)
        return (f"reward hacking suspected: over iterations {first.iteration}-{last.iteration} the eval reward rose "
                f"{rise:+.4f} while judge {name} fell {fall:+.4f} (noise allowance {allowance:.4f}); look at the eval "
                f"grids, and keep the best adapter (RUN/best)")

    @staticmethod
    def _monotone(series) -> int:
        """+1 when the means of the score lists rise at every step, -1 when they fall at every step, else 0."""
        means = [sum(s) / len(s) for s in series if s]
        steps = [b - a for a, b in zip(means, means[1:])]
        if steps and all(step > 0 for step in steps):
            return 1
        if steps and all(step < 0 for step in steps):
            return -1
        return 0

    def state_dict(self) -> list[dict]:
        return [{"iteration": s.iteration, "reward": s.reward, "judges": s.judges} for s in self.history]

    def load_state_dict(self, state: list[dict]) -> None:
        self.history = [EvalScores(s["iteration"], s["reward"], s["judges"]) for s in state]


class BestAdapter:
    """Which eval of the adapter scored highest on ``eval.best_by`` so far (the base model's eval does not count)."""

    def __init__(self, best_by: str):
        self.metric = metrics.EVAL_REWARD_MEAN if best_by == BEST_BY_REWARD else metrics.judge_key(best_by)
        self.label = "held-out reward" if best_by == BEST_BY_REWARD else f"judge {best_by}"
        self.evals = 0
        self.record: dict | None = None

    def consider(self, iteration: int, row: dict) -> bool:
        """Count the eval ``row`` of iteration ``iteration``; whether it beats every earlier one (then
        :attr:`record` is its)."""
        value = row.get(self.metric)
        if iteration < 1 or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        self.evals += 1
        improved = self.record is None or value > self.record["value"]
        if improved:
            self.record = {"iteration": iteration, "metric": self.metric, "label": self.label, "value": value}
        best = self.record
        self.record = {**best, "reason": f"the highest {self.label} ({best['value']:.4f}) of the {self.evals} evals of "
                                         f"the adapter so far, at iteration {best['iteration']}"}
        return improved

    def state_dict(self) -> dict:
        return {"evals": self.evals, "record": self.record}

    def load_state_dict(self, state: dict) -> None:
        self.evals, self.record = state["evals"], state["record"]
