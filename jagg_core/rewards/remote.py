"""A reward computed by a server the user runs.

Protocol: ``POST url`` with the JSON body ``{"images": [base64 PNG, ...], "prompts": [...]}`` (for an image-editing
model also ``"inputs": [base64 PNG, ...]``, the prompt rows' input images, and ``"instructions": [...]``);
the answer must be ``{"scores": [float, ...]}`` with one score per image. Connection failures,
time-outs and 5xx answers are retried ``retries`` times, ``retry_delay * 2**k`` seconds apart, all
within ``timeout`` seconds in total; a reply is read as it arrives and capped at 16 MB. A server
that stays down or breaks the protocol raises a one-line :class:`UserError`. Scores that are not
finite numbers, or a list of the wrong length, give NaN: the trainer skips that update (and fails
after several in a row).
"""

from __future__ import annotations

import base64
import json
import time
import warnings

import requests
import torch

from ..edit_prompts import png_bytes
from ..errors import UserError
from ..images import to_pil
from .base import Reward

MAX_REPLY_BYTES = 16 << 20


def encode_png(image) -> str:
    return base64.b64encode(png_bytes(image)).decode("ascii")


class HttpReward(Reward):
    """Scores from the server at ``options.url`` (options: :class:`~.catalog.HttpOptions`)."""

    name = "http"
    takes_inputs = True

    def post(self, payload: dict) -> bytes:
        """POST and read the reply, retrying connection errors, time-outs and 5xx answers, all within
        ``options.timeout`` seconds in total; a reply over :data:`MAX_REPLY_BYTES` is refused."""
        url, retries = self.options.url, self.options.retries
        deadline = time.monotonic() + self.options.timeout
        for attempt in range(retries + 1):
            try:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise requests.Timeout("the total time-out has passed")
                with requests.post(url, json=payload, timeout=remaining, stream=True) as response:
                    if response.status_code < 500:
                        body = self._read(response, deadline)
                        if response.status_code != 200:
                            raise UserError(f"reward server {url} answered HTTP {response.status_code}: "
                                            f"{body[:200]!r}")
                        return body
                    problem = f"HTTP {response.status_code}"
            except (requests.ConnectionError, requests.Timeout) as err:
                problem = type(err).__name__
            if attempt < retries and time.monotonic() + self.options.retry_delay * 2**attempt < deadline:
                time.sleep(self.options.retry_delay * 2**attempt)
        raise UserError(f"reward server {url} is not answering ({problem} after {attempt + 1} attempts within "
                        f"{self.options.timeout:g} s); is it running?")

    def _read(self, response: requests.Response, deadline: float) -> bytes:
        """The reply's body, read as it arrives, until the deadline or the size cap."""
        body = bytearray()
        while chunk := response.raw.read1(1 << 16, decode_content=True):
            body += chunk
            if len(body) > MAX_REPLY_BYTES:
                raise UserError(f"reward server {self.options.url} sent more than {MAX_REPLY_BYTES >> 20} MB; "
                                "it must answer {\"scores\": [numbers]}")
            if time.monotonic() > deadline:
                raise requests.Timeout("the reply did not arrive within the time-out")
        return bytes(body)

    def __call__(self, images, prompts, inputs=None):
        payload = {"images": [encode_png(image) for image in to_pil(images)], "prompts": list(prompts)}
        if inputs is not None:
            payload["inputs"] = [encode_png(image) for image in to_pil(inputs)]
            payload["instructions"] = [prompt.instruction for prompt in prompts]
        body = self.post(payload)
        try:
            scores = json.loads(body)["scores"]
        except (ValueError, KeyError, TypeError):
            scores = None
        if not isinstance(scores, list):
            raise UserError(f"reward server {self.options.url} must answer {{\"scores\": [numbers]}}; "
                            f"got {body[:200]!r}")
        if len(scores) != len(prompts):
            warnings.warn(f"reward server {self.options.url} returned {len(scores)} scores for {len(prompts)} images; "
                          "this update is skipped", stacklevel=2)
            return torch.full((len(prompts),), float("nan"))
        return torch.tensor([_number(score) for score in scores], dtype=torch.float32)


def _number(score) -> float:
    """A score as a float; anything that is not a number is NaN (the update is then skipped)."""
    return float(score) if isinstance(score, (int, float)) and not isinstance(score, bool) else float("nan")
