"""What the engine loop asks of a worker's role: one `Handoff` wrapped around the engine.

The loop (`pdserve.server.engine_process`) is the same for every worker: it gives the handoff
each request, abort and refused room, lets it move its rooms along (`poll`) before a step and
take the step's outputs (`on_step`) after it. A prefill or decode worker's handoff
(`pdserve.prefill`, `pdserve.decode`) queues requests around the engine while their KV moves;
a colocated worker's is `Colocated`, the null handoff: requests go straight to the engine.

Each role builds its own engine and handoff with a `WorkerFactory` that the command line picks
(`pdserve.{colocated,prefill,decode}.worker`), so the loop never names a role.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from pdserve.engine.config import EngineConfig
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.engine_messages import Bootstrap, DisaggStats, FailRoom

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine


class Handoff(ABC):
    """A worker's requests on their way into and out of its engine.

    The loop is single-threaded: it calls these between engine steps, never during one.
    """

    # "colocated", "prefill" or "decode": what the worker announces (`EngineReady.role`).
    role: ClassVar[str]
    # Where peers fetch this worker's KV (a prefill worker's bootstrap port), else None.
    bootstrap_port: int | None = None
    # What wakes the loop's wait for messages when a room changes (a transfer endpoint's
    # `Doorbell`: `fileno()` to poll, `answer()` once awake), else None.
    doorbell = None

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def disaggregated(self) -> bool:
        """Requests carry bootstrap fields (a room) exactly when this is True."""
        return self.role != "colocated"

    @abstractmethod
    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        bootstrap: Bootstrap | None,
    ) -> RequestOutput | None:
        """Take a request (`bootstrap` is None exactly when not `disaggregated`; the loop
        checks). Returns a failure output if it is refused at once; raises
        `InvalidRequestError` for a request the engine refuses."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """End the request wherever it is, in the handoff's queues or in the engine, freeing
        what it holds. False if neither knew it."""

    @abstractmethod
    def fail_room(self, msg: FailRoom) -> None:
        """The front end refused a request of this room before it reached the engine: tell
        whoever waits for the room."""

    @abstractmethod
    def poll(self) -> list[RequestOutput]:
        """Move requests along between steps; returns the outputs of those that ended or
        started producing (rooms that failed, arrived or finished sending)."""

    def on_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Take what the handoff needs from a step's outputs; returns what goes to the front
        end now. By default, everything."""
        return outputs

    @property
    def busy(self) -> bool:
        """Rooms are in flight outside the engine: the loop polls now and then while idle
        (their deadlines), beside the doorbell."""
        return False

    @abstractmethod
    def stats(self) -> DisaggStats | None:
        """The handoff's queues and transfer counters for `EngineStats` (None: no handoff)."""

    @abstractmethod
    def stop(self) -> None:
        """The worker is shutting down: end what is in flight, release endpoints."""


class Colocated(Handoff):
    """The null handoff of a colocated worker: prefill and decode both happen here."""

    role = "colocated"

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        bootstrap: Bootstrap | None,
    ) -> RequestOutput | None:
        self.engine.add_request(request_id, prompt_ids, params)
        return None

    def abort(self, request_id: str) -> bool:
        return self.engine.abort_request(request_id)

    def fail_room(self, msg: FailRoom) -> None:
        """A colocated worker has no rooms."""

    def poll(self) -> list[RequestOutput]:
        return []

    def stats(self) -> DisaggStats | None:
        return None

    def stop(self) -> None:
        """Nothing is in flight outside the engine."""


# Builds a worker's engine and handoff in the engine process (the handoff holds the engine).
# NOTE: it travels to a spawned process, so it must pickle: a module-level function, or a
# functools.partial of one over picklable settings.
WorkerFactory = Callable[[EngineConfig], Handoff]
