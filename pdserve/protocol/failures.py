"""Why a request failed, as a type: one `FailureKind` per cause, one table from kind to HTTP
status and retry, and the `Failure` that travels from a transfer room to the engine output, the
HTTP answer and the router. Nothing reads a failure's message to decide anything: rewording a
message changes no status and no retry. Torch-free.
"""

from __future__ import annotations

import enum
import logging
from typing import NamedTuple

from pdserve.protocol.codec import message


class FailureKind(enum.StrEnum):
    INVALID = "invalid"  # the request itself is at fault (too long, bad room id): 400
    NO_PAGES = "no_pages"  # a worker had no KV pages for it in time
    TIMEOUT = "timeout"  # a transfer made no progress within its deadline
    PEER_LOST = "peer_lost"  # the peer worker fell silent, closed, or restarted
    HANDSHAKE = "handshake"  # the pair could not register (layout, backend, token)
    ABORTED = "aborted"  # the router, the client or the peer ended the room
    TRANSFER = "transfer"  # the KV bytes or metadata arrived wrong, or the link broke
    UNAVAILABLE = "unavailable"  # the worker's engine is not running
    INTERNAL = "internal"  # a bug: the engine failed on the request


class Outcome(NamedTuple):
    status: int
    retryable: bool  # another pair (or a later try) may succeed


OUTCOMES: dict[FailureKind, Outcome] = {
    FailureKind.INVALID: Outcome(400, False),
    FailureKind.NO_PAGES: Outcome(503, True),
    FailureKind.TIMEOUT: Outcome(503, True),
    FailureKind.PEER_LOST: Outcome(503, True),
    FailureKind.HANDSHAKE: Outcome(503, True),
    FailureKind.ABORTED: Outcome(503, True),
    FailureKind.TRANSFER: Outcome(503, True),
    FailureKind.UNAVAILABLE: Outcome(503, True),
    FailureKind.INTERNAL: Outcome(500, False),
}


class FailureStage(enum.StrEnum):
    BOOTSTRAP = "bootstrap"  # before any KV moved (handshake, reservation, queue)
    TRANSFER = "transfer"  # while the KV moved
    ENGINE = "engine"  # in an engine (admission, a step)


@message("failure")
class Failure:
    kind: FailureKind
    stage: FailureStage
    message: str

    @property
    def status(self) -> int:
        return OUTCOMES[self.kind].status

    @property
    def label(self) -> str:
        """The metric label, "stage/kind": a closed set."""
        return f"{self.stage.value}/{self.kind.value}"


# Failures that are no worker's fault (the request was invalid, or someone ended it): a
# worker logs them at INFO, so that a WARNING always means something on the server side.
CLIENT_KINDS = frozenset({FailureKind.INVALID, FailureKind.ABORTED})


def log_level(failure: Failure) -> int:
    """The level a worker logs `failure` at: INFO for the client's own (`CLIENT_KINDS`),
    WARNING for the rest."""
    return logging.INFO if failure.kind in CLIENT_KINDS else logging.WARNING


def outcome_of_code(code: object) -> Outcome | None:
    """The outcome for an error body's `code` (a FailureKind value), None for other codes."""
    try:
        return OUTCOMES[FailureKind(code)]
    except ValueError:
        return None
