"""A seam for tests: hold a worker's engine loop at a chosen point, so that a test acts while a
request is exactly there (kill a prefill worker mid-prefill, before any KV was sent) instead of
buying the time with a long prompt computed a token a step.

`PDSERVE_HOLD_AT=POINT:DIRECTORY` in an engine process's environment (tests set it through
`LocalServer(env=...)`; nothing else reads it) sets up one hold, armed once `DIRECTORY/armed`
exists (so a test can send requests that pass first). The first time the loop reaches POINT
armed, it writes `DIRECTORY/held` (the request's id inside) and stops there until
`DIRECTORY/release` exists or `HOLD_DEADLINE_S` passed, then goes on as if nothing happened.
Unset, the loop pays one attribute test per turn.

Points:
- `prefill-started`: after a step that computed part of a prompt, not all of it (set
  `--chunked-prefill-size` below the prompt's length): the request runs, nothing was sampled,
  and a prefill worker has sent none of its KV (pieces go once a prompt is computed, or once
  they reach `--transfer-piece-bytes`, which a short prompt never does).
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from collections.abc import Iterable

from pdserve.engine.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)

ENV = "PDSERVE_HOLD_AT"
POINTS = ("prefill-started",)
HOLD_DEADLINE_S = 60.0
POLL_S = 0.01


class HoldPoint:
    """One armed hold (see the module docstring)."""

    def __init__(self, point: str, directory: str):
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown hold point {point!r}; choose one of {POINTS}")
        self.point = point
        self.directory = pathlib.Path(directory)
        self.spent = False

    @classmethod
    def from_env(cls) -> HoldPoint | None:
        spec = os.environ.get(ENV)
        if not spec:
            return None
        point, _, directory = spec.partition(":")
        if not directory:
            raise ValueError(f"{ENV} must be POINT:DIRECTORY, got {spec!r}")
        return cls(point, directory)

    def after_step(self, requests: Iterable[Request]) -> None:
        """Called after each step with the engine's live requests."""
        if self.spent:
            return
        for request in requests:
            computing = request.status is RequestStatus.RUNNING
            if computing and 0 < request.num_computed_tokens < len(request.prompt_token_ids):
                if (self.directory / "armed").exists():
                    self._hold(request.request_id)
                return

    def _hold(self, request_id: str) -> None:
        self.spent = True
        staged = self.directory / "held.tmp"
        staged.write_text(request_id)
        staged.rename(self.directory / "held")  # NOTE: whole, so a test never reads it half
        logger.warning("test hold point %s reached by request %s: holding", self.point, request_id)
        deadline = time.monotonic() + HOLD_DEADLINE_S
        release = self.directory / "release"
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(POLL_S)
