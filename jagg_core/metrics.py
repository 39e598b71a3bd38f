"""The metric keys of ``RUN/metrics.jsonl``, defined once for the trainer, the app, the model card and the bench.

One JSON object per iteration, with namespaced keys (as TensorBoard and TRL group them)::

    iteration              0 = the base model's eval, then 1..N
    reward/mean, reward/std        rollout reward over all processes (finite values)
    reward/NAME            mean of each reward term (NAME as in the combined reward; ``mean`` and ``std`` are taken)
    reward_spread/NAME     each term's weighted score |w| r's standard deviation within a group, averaged over the
                           rollout's groups: how much of the group advantage's signal the term gives (under
                           ``grpo.multi_reward: sum`` the terms' shares of it; :func:`jagg_core.grpo.group_spread`)
    eval/reward_mean       mean reward of the fixed-seed ODE samples of the held-out prompts (eval iterations)
    eval/reward/NAME       the same for each reward term
    eval/judge/NAME        mean score of each judge (``eval.judges``: rewards that score the eval samples only, never
                           training), on the same samples
    eval/hacking_alarm     on the eval where the reward-hacking alarm fired: its one line (:mod:`jagg_core.judges`)
    train/loss, train/kl, train/ratio_mean, train/clip_frac, train/grad_norm, train/lr
    train/ratio_max_dev    grpo: max |ratio - 1| of the first (on-policy) optimizer step over its samples and trained
                           steps; 0 up to rounding when the rollout and the training pass agree
    train/policy_loss      nft, awm: the loss without its KL terms
    train/lag_deviation    nft, awm: mean squared distance of the velocity to the lagging policy's (NFT's old policy,
                           AWM's EMA regularizer) on the trained rows
    train/skipped          the update was skipped (non-finite reward or gradient)
    jagg/windows, jagg/routed_frac, jagg/linearity_mean, jagg/backward_passes
    jagg/grad_cosine, jagg/grad_rel_err, jagg/window_cosines   the fidelity audit (audited iterations only,
                           ``backward.audit_every``): cos(g_jagg, g_exact), |g_jagg - g_exact| / |g_exact| and
                           each window's cosine, a list (:mod:`jagg_core.audit`)
    time/rollout_s, time/train_s, time/audit_s, time/eval_s    seconds of the phases of the iteration (the
                           update's own in train_s; the audit's apart)

Run directories written before these names used flat keys (``reward_mean``, ``time_rollout_s`` ...);
:func:`normalize` maps a row of either kind to the namespaced keys, so old runs still display.
"""

from __future__ import annotations

ITERATION = "iteration"
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
EVAL_REWARD_MEAN = "eval/reward_mean"
LOSS = "train/loss"
KL = "train/kl"
RATIO_MEAN = "train/ratio_mean"
RATIO_MAX_DEV = "train/ratio_max_dev"
CLIP_FRAC = "train/clip_frac"
GRAD_NORM = "train/grad_norm"
POLICY_LOSS = "train/policy_loss"
LAG_DEVIATION = "train/lag_deviation"
LEARNING_RATE = "train/lr"
SKIPPED = "train/skipped"
JAGG_WINDOWS = "jagg/windows"
JAGG_ROUTED_FRAC = "jagg/routed_frac"
JAGG_LINEARITY_MEAN = "jagg/linearity_mean"
BACKWARD_PASSES = "jagg/backward_passes"
JAGG_GRAD_COSINE = "jagg/grad_cosine"
JAGG_GRAD_REL_ERR = "jagg/grad_rel_err"
JAGG_WINDOW_COSINES = "jagg/window_cosines"
TIME_ROLLOUT = "time/rollout_s"
TIME_TRAIN = "time/train_s"
TIME_AUDIT = "time/audit_s"
TIME_EVAL = "time/eval_s"
JUDGE_PREFIX = "eval/judge/"
HACKING_ALARM = "eval/hacking_alarm"
#: the seconds an iteration spends, phase by phase (a phase it skipped is absent from its row)
PHASE_TIMES = (TIME_ROLLOUT, TIME_TRAIN, TIME_AUDIT, TIME_EVAL)


def seconds(row: dict) -> float:
    """The seconds of a metrics row's iteration: the sum of its :data:`PHASE_TIMES`."""
    return sum(row.get(key, 0.0) for key in PHASE_TIMES)


def reward_part(name: str) -> str:
    """The key of one reward term's mean."""
    return f"reward/{name}"


def reward_spread(name: str) -> str:
    """The key of one reward term's weighted spread within the rollout's groups."""
    return f"reward_spread/{name}"


def eval_reward_part(name: str) -> str:
    """The key of one reward term's mean on the eval samples."""
    return f"eval/reward/{name}"


def judge_key(name: str) -> str:
    """The key of one judge's mean on the eval samples."""
    return f"{JUDGE_PREFIX}{name}"


def judge_names(rows: list[dict]) -> list[str]:
    """The judges that scored any of ``rows``, in the order they first appear."""
    names = (key.removeprefix(JUDGE_PREFIX) for row in rows for key in row if key.startswith(JUDGE_PREFIX))
    return list(dict.fromkeys(names))


#: flat key of the first run directories -> namespaced key
LEGACY_KEYS = {
    "reward_mean": REWARD_MEAN, "reward_std": REWARD_STD, "eval_reward_mean": EVAL_REWARD_MEAN, "loss": LOSS,
    "kl": KL, "ratio_mean": RATIO_MEAN, "clip_frac": CLIP_FRAC, "grad_norm": GRAD_NORM, "lr": LEARNING_RATE,
    "skipped": SKIPPED, "jagg_windows": JAGG_WINDOWS, "jagg_routed_frac": JAGG_ROUTED_FRAC,
    "jagg_linearity_mean": JAGG_LINEARITY_MEAN, "backward_passes": BACKWARD_PASSES, "time_rollout_s": TIME_ROLLOUT,
    "time_train_s": TIME_TRAIN,
}


def normalize(row: dict) -> dict:
    """``row`` with flat legacy keys renamed (``reward_NAME`` -> ``reward/NAME``); namespaced keys pass."""
    renamed = {}
    for key, value in row.items():
        if key in LEGACY_KEYS:
            key = LEGACY_KEYS[key]
        elif key.startswith("reward_") and "/" not in key:
            key = reward_part(key.removeprefix("reward_"))
        renamed[key] = value
    return renamed
