"""Benchmark: the exact backward against JAGG, side by side, in one run.

    python -m jagg_core.bench [--quick] [--json OUT.json] [--table OUT.md] [--plot OUT.png] [--models A,B]
    python -m jagg_core.bench --arch NAME --random-weights [--layers N] [--resolution R] [--quantize nf4|int8]
    python -m jagg_core.bench --fidelity ROLLOUTS ...     (adds section 5)
    python -m jagg_core.bench --training [--setups flow_grpo,exact,default,flat] [--models M] [--json|--table|--plot OUT]

Every comparison runs in one process on the same model, the same rollout batch and the same seeds,
through the project's own code: :class:`~jagg_core.trainer.Trainer` (set-up, rollout, iterations),
:meth:`~jagg_core.algorithms.grpo.GrpoAlgorithm.plan_backward` and
:meth:`~jagg_core.algorithms.grpo.GrpoAlgorithm.accumulate_gradients`
(``make_plan`` + ``run_backward``) under one :class:`~jagg_core.config.BackwardConfig` per variant.

1. **Train phase** (the backward of one rollout batch, LoRA gradients from zero) for ``exact`` and
   the JAGG modes ``forward`` (a no-grad forward per intermediate step, the paper), ``cached``
   (rollout velocities with the endpoint correction) and ``cached_shared`` (plus shared knots), at
   each window W, with joint (stacked) and sequential endpoints. Seconds are the minimum over
   repeats after a warm-up, the variants interleaved within each repeat so that load from other
   processes falls on all of them alike. Peak memory is the increment over the memory before the
   backward (see :func:`~jagg_core.bench.memory.peak_memory`); gradients are compared with the exact one (cosine,
   relative norm error of the flattened LoRA gradient).
2. The same on each model of ``--models``: by default the embedded pretrained model (or tiny-sd3
   while there is none) and ``bench-sd3-31m``, a DiT large enough to be compute-bound on a CPU.
3. **Whole iterations** (rollout + train) of short trainings on each model, alternating
   iteration by iteration, for each seed: Flow-GRPO's default (every step SDE, exact backward, reference in the
   rollout), the exact backward with the default's rollout, the default, and the default with tree rollouts or,
   when it has them (the default task), without (:func:`~jagg_core.bench.training.comparison_setups`); reward
   against wall-clock goes to ``--plot``. The default's training is audited at every iteration
   (``backward.audit_every``), timed apart: the cost of one audit against an iteration's.
4. **Routing**: the linearity score of every window (``linearity`` in each row) and rows with
   ``frac < 1`` (section ``routing``).
5. **Fidelity** (``--fidelity``, :mod:`jagg_core.bench.fidelity`): each window's audited gradient cosine along the
   trajectory, and how well the routing predictors rank it (section ``fidelity``).

``--training`` runs instead whole trainings of the setups ``--setups`` (default: the exact backward and the default)
over three seeds (:mod:`jagg_core.bench.training`).

Every train-phase row also has the seconds of one rollout of the same batch (``rollout_s``, timed once per
repeat among the variants), so ``iteration_s = rollout_s + train_s`` and ``iteration_speedup`` compare whole
iterations, and the rollout's peak memory (``rollout_peak_mem_mb``).

**Real architectures** (``--arch``): one model, a real architecture of :mod:`jagg_core.archs` with random
weights (``--random-weights``: ``model.name = random:ARCH[@LAYERS]``, built from the shipped configs, no
download) or the Hub model's own weights, on the bench's rollout batch at ``--resolution``, in bf16 with
bf16 autocast on a GPU (float32 on a CPU), through the same machinery: exact and JAGG at W = 2, 4, 5
(forward and cached velocities, joint and sequential endpoints), see :data:`~jagg_core.bench.archs.ARCH_OPTIONS`.

The JSON is a list of rows; every row has :data:`~jagg_core.bench.rows.ROW_KEYS` (``None`` where a figure does not
apply).

One module per part, in the order of the data: ``variants`` (the variant grid, :class:`BenchOptions`, each model's
config), ``archs`` (the real-architecture options), ``workload`` (a model, its rollout batch, each variant's timed
backward), ``memory`` (peak memory, through a subprocess on a CPU), ``rows`` (the train phase's rows),
``iterations`` (whole iterations), ``training`` (whole trainings), ``fidelity`` (fidelity along the trajectory),
``tables`` (Markdown, plot, JSON) and ``cli`` (the command line, every section in order). Nothing outside this
package imports it but the GPU check (:mod:`jagg_core.gpu_check`, whose step 3 is the bench); the names below are
what the GPU check and the real-architecture tests use.
"""

from .archs import arch_model, arch_options, arch_overrides
from .cli import main
from .rows import ROW_KEYS, bench_train_phase
from .variants import EXACT, BenchOptions, Variant

__all__ = ["EXACT", "ROW_KEYS", "BenchOptions", "Variant", "arch_model", "arch_options", "arch_overrides",
           "bench_train_phase", "main"]
