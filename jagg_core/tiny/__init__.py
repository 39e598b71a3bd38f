"""``jagg-shapes``: the small, real text-to-image pipeline embedded in JAGG Studio.

* the coloured-shapes world (palette, caption grammar, drawing) is :mod:`jagg_core.shapes_world`;
* :mod:`.dataset`: training / held-out captions and jittered training images;
* :mod:`.tokenizer`: a word-level CLIP tokenizer over the caption vocabulary;
* :mod:`.padded_attention`: exact, cheaper training with the SD3 pipeline's zero T5 padding;
* :mod:`.build`: ``python -m jagg_core.tiny.build`` trains the VAE, the two CLIP text encoders
  and the SD3 transformer on the CPU and writes ``jagg_core/assets/jagg-shapes``;
* :mod:`.evaluate`: ``python -m jagg_core.tiny.evaluate`` scores ODE samples of the 64 held-out
  captions with the ``shapes`` reward (:mod:`jagg_core.rewards.shapes`).
"""

from pathlib import Path

#: Where the build writes the pipeline folder, and the name presets use for it.
PIPELINE_NAME = "jagg-shapes"
PIPELINE_DIR = Path(__file__).resolve().parent.parent / "assets" / PIPELINE_NAME
