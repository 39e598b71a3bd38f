"""Video samples on disk and the frames that stand for them; no deep-learning library (the run directory uses it).

A video family's sample is ``F`` frames (``sampling.num_frames``). The run directory writes each as an H.264 MP4 at
``sampling.fps`` beside a frame-strip PNG (:func:`jagg_core.images.frame_strip`); rewards score
``sampling.reward_frames`` of its frames, chosen by :func:`frame_indices`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: frames side by side in the strip PNG that stands for a video sample
STRIP_FRAMES = 8


def frame_indices(num_frames: int, count: int) -> list[int]:
    """``count`` frame indices evenly spaced from the first frame to the last, ``round(k (F - 1) / (count - 1))`` for
    ``k = 0 .. count - 1``; every frame when ``count >= F``, the first alone when ``count == 1``."""
    if count >= num_frames:
        return list(range(num_frames))
    if count == 1:
        return [0]
    return [round(k * (num_frames - 1) / (count - 1)) for k in range(count)]


def write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    """Frames ``uint8 [F, H, W, 3]`` as an H.264 MP4 (yuv420p, what browsers play) at ``fps``, through the ffmpeg
    binary that imageio-ffmpeg ships."""
    import imageio_ffmpeg

    height, width = frames.shape[1:3]
    writer = imageio_ffmpeg.write_frames(str(path), (width, height), fps=fps, codec="libx264", pix_fmt_out="yuv420p",
                                         quality=8, macro_block_size=16, ffmpeg_log_level="error")
    writer.send(None)  # start the encoder
    for frame in frames:
        writer.send(np.ascontiguousarray(frame))
    writer.close()
