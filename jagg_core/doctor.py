"""The first iteration's doctor: a checklist of what makes RL fine-tuning learn nothing or learn the wrong thing, each
line passed, failed (with its fix) or skipped (it does not apply).

1. **Rewards are finite and vary within groups.** An advantage is a reward relative to its group's; a group whose
   rewards are all equal gives zero advantages and no gradient. It fails when a reward is not finite or fewer than
   half of the groups vary (spread above ``1e-6 (1 + |mean|)``).
2. **The on-policy ratio is 1.** GRPO's first optimizer step runs on the policy that made the rollout, so
   ``exp(logp - logp_old)`` must be 1 at every trained step and sample; ``max |ratio - 1| <= 1e-3`` (else the rollout
   and the training pass compute different velocities: dtype, dropout, CFG, a scheduler mismatch).
3. **The LoRA gradient is finite and non-zero, and the first step changes the velocity**, measured on a probe: the
   first rollout sample re-noised to sigma 0.5 with a fixed noise, its velocity before and after the update.
4. **The base model's eval reward is in each reward's expected range** (:data:`~jagg_core.rewards.catalog.CATALOG`'s
   ``expected_range``, the scores a working model's samples get): outside, the reward or the model is broken.
5. **The JAGG gradient agrees with the exact one** (GRPO with interpolated steps): the fidelity audit's cosine on the
   first rollout, at least ``backward.min_fidelity`` when set, else :data:`MIN_AUDIT_COSINE`.
6. **The prompts fit the text encoders' windows that a setting sizes**: no prompt is longer than the
   ``model.max_sequence_length`` tokens its encoder reads (counted at set-up, :mod:`jagg_core.models.text_windows`);
   a window the encoder fixes (CLIP's 77 tokens) only reports the prompts it cuts.
7. **Each of several rewards moves the advantage.** A reward's signal is its weighted score's spread within groups,
   ``|w| mean_g std_g(r)`` (``reward_spread/NAME``). Under ``grpo.multi_reward: sum`` the advantage follows the
   widest: a reward whose signal is below :data:`MIN_REWARD_SIGNAL` of the widest's is next to untrained (PickScore
   beside ``clip_score`` at equal weights: about 1%). Under ``per_reward`` each reward moves its weight's share, but
   a reward that gives every sample of a group the same score moves none. One reward: skipped.

:class:`Probe` holds the velocity probe; :func:`checklist` turns the measurements into the report written to
``RUN/doctor.json``, the status and the log.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .config import RunConfig
from .models.base import Conditioning, FlowModel
from .models.text_windows import WindowReading
from .rng import forked_rng

#: the largest on-policy ``|ratio - 1|`` that passes
MAX_RATIO_DEVIATION = 1e-3
#: the audit cosine that passes when ``backward.min_fidelity`` is not set: below it the JAGG gradient is closer to
#: orthogonal than to the exact one
MIN_AUDIT_COSINE = 0.5
PROBE_SIGMA = 0.5
#: under ``grpo.multi_reward: sum``, the least signal (weighted spread within groups) a reward may give, as a share of
#: the widest reward's, before the doctor says it is drowned out
MIN_REWARD_SIGNAL = 0.1


@dataclass
class Check:
    check: str
    status: str          # pass, fail or skip
    detail: str
    fix: str = ""


def passed(check: str, detail: str) -> Check:
    return Check(check, "pass", detail)


def failed(check: str, detail: str, fix: str) -> Check:
    return Check(check, "fail", detail, fix)


def skipped(check: str, detail: str) -> Check:
    return Check(check, "skip", detail)


# ----- the checks ------------------------------------------------------------------------------
def rewards_check(rewards: torch.Tensor, group_size: int) -> Check:
    """Check 1 on every process's rollout rewards (consecutive groups of ``group_size``)."""
    name = "rewards are finite and vary within groups"
    if not torch.isfinite(rewards).all():
        bad = int((~torch.isfinite(rewards)).sum())
        return failed(name, f"{bad} of {rewards.numel()} rewards are NaN or infinite",
                      "make the reward return a finite score for every image (a reward server's errors, a division "
                      "by zero)")
    groups = rewards.double().reshape(-1, group_size)
    spread = groups.std(1, unbiased=False)
    varied = int((spread > 1e-6 * (1 + groups.mean(1).abs())).sum())
    detail = f"{varied} of {len(groups)} groups vary (mean spread {float(spread.mean()):.4g})"
    if 2 * varied < len(groups):
        return failed(name, detail, "the reward gives every sample of a prompt the same score, so the advantages are "
                      "zero: use a reward that tells the samples apart, raise sampling.noise_level (GRPO) or "
                      "grpo.num_generations")
    return passed(name, detail)


def ratio_check(deviation: float | None) -> Check:
    """Check 2 from the first step's ``max |ratio - 1|`` (None: the algorithm has no ratio)."""
    name = "the on-policy ratio exp(logp - logp_old) is 1"
    if deviation is None:
        return skipped(name, "no likelihood ratio in this algorithm")
    detail = f"max |ratio - 1| = {deviation:.2e} (limit {MAX_RATIO_DEVIATION:g})"
    if not math.isfinite(deviation) or deviation > MAX_RATIO_DEVIATION:
        return failed(name, detail, "the rollout and the training pass disagree: use the same dtype for both "
                      "(train.mixed_precision no, model.dtype float32), lora.dropout 0, the same guidance_scale")
    return passed(name, detail)


def gradient_check(grad_norm: float | None, velocity_change: float | None) -> Check:
    """Check 3 from the first step's gradient norm (before clipping) and the probe's relative velocity change."""
    name = "the LoRA gradient is finite and non-zero and moves the velocity"
    if grad_norm is None:
        return failed(name, "no update was made (the rewards were not finite)", "fix the reward first")
    detail = f"gradient norm {grad_norm:.3e}, velocity change {velocity_change:.3e} (relative)"
    if not math.isfinite(grad_norm):
        return failed(name, detail, "the gradient overflowed: lower train.learning_rate, use train.mixed_precision "
                      "bf16 instead of fp16, or check the reward's scale")
    if grad_norm == 0:
        return failed(name, detail, "no gradient reaches the LoRA: check lora.target_modules names layers of the "
                      "transformer, and that the rewards vary within groups")
    if not (velocity_change and math.isfinite(velocity_change)):
        return failed(name, detail, "the update did not change the model's output: raise train.learning_rate, "
                      "check lora.alpha is not 0")
    return passed(name, detail)


def range_check(base_row: dict | None, ranges: dict[str, tuple[float | None, float | None]]) -> Check:
    """Check 4 from the base eval's row (``eval/reward/NAME`` per reward term) and each term's expected range."""
    name = "the base model's eval reward is in the reward's range"
    if not base_row:
        return skipped(name, "no base eval in this run (a resumed run)")
    outside, inside = [], []
    for term, (low, high) in ranges.items():
        value = base_row.get(f"eval/reward/{term}")
        if value is None or (low is None and high is None):
            continue
        words = f"{term} {value:.4g} in [{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        ok = math.isfinite(value) and (low is None or value >= low) and (high is None or value <= high)
        (inside if ok else outside).append(words)
    if outside:
        return failed(name, "outside: " + "; ".join(outside), "the base model's samples score where a working model's "
                      "do not: check the base model loads (model.name, model.dtype), sampling.resolution and "
                      "num_steps suit it, and the reward's options (model_id)")
    if not inside:
        return skipped(name, "no reward of this run has a documented range")
    return passed(name, "; ".join(inside))


def audit_check(cosine: float | None, config: RunConfig) -> Check:
    """Check 5 from the first rollout's audit cosine (None: nothing interpolated, or not GRPO)."""
    name = "the JAGG gradient agrees with the exact one"
    if cosine is None:
        return skipped(name, "no JAGG-interpolated step (another algorithm, backward.mode exact or windows of 2)")
    threshold = config.backward.min_fidelity if config.backward.min_fidelity is not None else MIN_AUDIT_COSINE
    detail = f"audit cosine {cosine:.3f} (threshold {threshold:g})"
    if not math.isfinite(cosine) or cosine < threshold:
        return failed(name, detail, "the windows are too curved for interpolation here: lower backward.window, set "
                      "backward.velocities forward, route poor windows to the exact backward (backward.min_fidelity "
                      "with backward.audit_every), or use backward.mode exact")
    return passed(name, detail)


def text_window_check(readings: list[WindowReading]) -> Check:
    """Check 6 from set-up's readings of the text encoders' windows."""
    name = "the prompts fit the text encoders' windows"
    detail = "; ".join(f"{r.window.encoder} reads {r.window.limit} tokens, the longest prompt takes {r.longest}"
                       + (f" ({r.over} of {r.prompts} are longer)" if r.over else "") for r in readings)
    cut = [r for r in readings if r.fixable]
    if cut:
        return failed(name, detail, "; ".join(f"set {r.window.setting}={r.longest}" for r in cut)
                      + " to keep every prompt whole, or shorten the longer prompts")
    return passed(name, detail)


def reward_balance_check(signals: dict[str, float], weights: dict[str, float], multi_reward: str) -> Check:
    """Check 7 from each reward's signal ``|w| mean_g std_g(r)`` (term name -> value) and weight ``w``."""
    name = "each reward moves the advantage"
    if len(signals) < 2:
        return skipped(name, "one reward")
    widest = max(signals, key=signals.get)
    detail = "signal (weighted spread within groups) " + ", ".join(f"{term} {value:.3g}" for term, value in
                                                                   signals.items())
    silent = [term for term, value in signals.items() if not value > 0]
    if silent:
        return failed(name, detail, f"{', '.join(silent)} gives every sample of a group the same score, so it trains "
                      "nothing: use a reward that tells the samples apart, or remove it")
    if multi_reward == "per_reward":
        return passed(name, detail + " (per_reward: each its weight's share)")
    drowned = [term for term, value in signals.items() if value < MIN_REWARD_SIGNAL * signals[widest]]
    if drowned:
        raised = " and ".join(f"{term}'s weight to {weights[term] * signals[widest] / signals[term]:.3g}"
                              for term in drowned)
        return failed(name, f"{detail}: under grpo.multi_reward sum the advantage is {widest}'s nearly alone",
                      f"raise {raised} (a signal then matches {widest}'s), or set "
                      "grpo.multi_reward=per_reward (each reward moves its weight's share of the advantage)")
    return passed(name, detail)


def checklist(iteration: int, checks: list[Check]) -> dict:
    """The report: ``{"iteration", "passed", "checks": [{"check", "status", "detail", "fix"}]}``."""
    return {"iteration": iteration, "passed": all(c.status != "fail" for c in checks),
            "checks": [asdict(c) for c in checks]}


def report_lines(report: dict) -> list[str]:
    """The report as log lines: a summary, then one line a check (a failed one with its fix)."""
    counts = {status: sum(c["status"] == status for c in report["checks"]) for status in ("pass", "fail", "skip")}
    lines = [f"doctor (iteration {report['iteration']}): {counts['pass']} passed, {counts['fail']} failed, "
             f"{counts['skip']} skipped"]
    for check in report["checks"]:
        mark = {"pass": "ok  ", "fail": "FAIL", "skip": "skip"}[check["status"]]
        fix = f" -> fix: {check['fix']}" if check["status"] == "fail" else ""
        lines.append(f"  [{mark}] {check['check']}: {check['detail']}{fix}")
    return lines


# ----- the velocity probe ----------------------------------------------------------------------------
class Probe:
    """One fixed input of the transformer: a rollout's first clean latent re-noised to :data:`PROBE_SIGMA` with noise
    from its own generator, and its conditioning. :meth:`velocity` draws nothing from the global generators, so the
    run is the same with or without the doctor."""

    def __init__(self, model: FlowModel, latents: torch.Tensor, cond: Conditioning, autocast):
        self.model, self.autocast = model, autocast
        clean = latents[:1].float()
        noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(0)).to(clean.device)
        self.z = ((1 - PROBE_SIGMA) * clean + PROBE_SIGMA * noise).to(latents.dtype)
        self.sigma = torch.full((1,), PROBE_SIGMA, device=latents.device)
        self.cond = {key: value[:1] for key, value in cond.items()}

    @torch.no_grad()
    def velocity(self) -> torch.Tensor:
        device = self.z.device
        with forked_rng(device), self.autocast():
            return self.model.velocity(self.z, self.sigma, self.cond).float()

    @staticmethod
    def change(before: torch.Tensor, after: torch.Tensor) -> float:
        """``|after - before| / |before|``."""
        return float((after - before).norm() / before.norm().clamp(min=1e-12))
