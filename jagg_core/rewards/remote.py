"""A reward computed by a server the user runs.

Protocol: ``POST url`` with the JSON body ``{"images": [base64 PNG, ...], "prompts": [...]}``;
the answer must be ``{"scores": [float, ...]}`` with one score per image. Connection failures,
timeouts and 5xx answers are retried ``retries`` times, ``retry_delay * 2**k`` seconds apart;
a server that stays down or answers badly raises a one-line :class:`UserError`.
"""

from __future__ import annotations

import base64
import io
import math
import time

import requests
import torch

from ..errors import UserError
from ..images import to_pil
from .base import Reward


def encode_png(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class HttpReward(Reward):
    """Scores from the server at ``options.url`` (options: :class:`~.catalog.HttpOptions`)."""

    name = "http"

    def post(self, payload: dict) -> requests.Response:
        """POST with retries on connection errors, timeouts and 5xx answers."""
        url, retries = self.options.url, self.options.retries
        for attempt in range(retries + 1):
            try:
                response = requests.post(url, json=payload, timeout=self.options.timeout)
                if response.status_code < 500:
                    return response
                problem = f"HTTP {response.status_code}"
            except (requests.ConnectionError, requests.Timeout) as err:
                problem = type(err).__name__
            if attempt < retries:
                time.sleep(self.options.retry_delay * 2**attempt)
        raise UserError(f"reward server {url} is not answering ({problem} after {retries + 1} attempts); "
                        f"is it running?")

    def __call__(self, images, prompts):
        response = self.post({"images": [encode_png(image) for image in to_pil(images)], "prompts": list(prompts)})
        if response.status_code != 200:
            raise UserError(f"reward server {self.options.url} answered HTTP {response.status_code}: {response.text[:200]!r}")
        try:
            scores = response.json()["scores"]
            values = [float(score) for score in scores]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"reward server {self.options.url} must answer {{\"scores\": [numbers]}}; "
                            f"got {response.text[:200]!r}") from None
        if len(values) != len(prompts) or not all(math.isfinite(v) for v in values):
            raise UserError(f"reward server {self.options.url} returned {len(values)} scores for {len(prompts)} images "
                            f"(all must be finite numbers)")
        return torch.tensor(values, dtype=torch.float32)
