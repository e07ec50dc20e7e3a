"""The one way tests wait for something: poll a condition until it holds or a deadline passes.

A timeout on a busy CI machine should be readable from its message alone: it says what was
awaited, for how long and how many times it was checked, what the condition last gave (a
value or a retried exception), and, through `describe`, the state of whatever was awaited
(a worker's counters, a log's tail)."""

from __future__ import annotations

import pprint
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    what: str,
    deadline_s: float = 20.0,
    poll_s: float = 0.02,
    *,
    describe: Callable[[], object] | None = None,
    retry_on: tuple[type[Exception], ...] = (),
) -> T:
    """Call `predicate` every `poll_s` seconds until it returns something truthy; return that.

    An exception of a `retry_on` type counts as "not yet" (a server still starting up); any
    other propagates at once, noting what was awaited. Past `deadline_s`, raises
    AssertionError naming `what`, the time waited, the predicate's last result or retried
    exception, and `describe()` (called once, then) if given."""
    started = time.monotonic()
    checks = 0
    while True:
        checks += 1
        try:
            result = predicate()
        except retry_on as e:
            last = f"the condition last raised {type(e).__name__}: {e}"
        except Exception as e:
            e.add_note(f"(raised while waiting for {what})")
            raise
        else:
            if result:
                return result
            last = f"the condition last returned {result!r}"
        waited = time.monotonic() - started
        if waited > deadline_s:
            raise AssertionError(_timeout_message(what, waited, deadline_s, checks, last, describe))
        time.sleep(poll_s)


def _timeout_message(
    what: str,
    waited: float,
    deadline_s: float,
    checks: int,
    last: str,
    describe: Callable[[], object] | None,
) -> str:
    lines = [
        f"timed out waiting for {what}: {waited:.1f} s (deadline {deadline_s} s), {checks} checks",
        last,
    ]
    if describe is not None:
        try:
            state = describe()
        except Exception as e:  # NOTE: a dead worker must not hide the timeout behind it
            state = f"describe() raised {type(e).__name__}: {e}"
        lines.append(f"state at the timeout:\n{_readable(state)}")
    return "\n".join(lines)


def _readable(state: object) -> str:
    """A string as is; a map one entry a line (one worker's counters each); else pprint."""
    if isinstance(state, str):
        return state
    if isinstance(state, dict):
        return "\n".join(f"  {key}: {value!r}" for key, value in state.items())
    return pprint.pformat(state, width=100)
