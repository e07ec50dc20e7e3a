"""tests/waiting.py: the shared poll-with-deadline, and what its timeout message tells."""

from __future__ import annotations

import itertools

import pytest

from tests.waiting import wait_until


def test_returns_the_first_truthy_result():
    counter = itertools.count()
    assert wait_until(lambda: next(counter) >= 3 and "ready", "the counter", 5, poll_s=0) == "ready"


def test_a_timeout_names_what_how_long_and_the_last_result():
    with pytest.raises(AssertionError) as info:
        wait_until(lambda: 0, "the worker to idle", 0.05, poll_s=0.01)
    message = str(info.value)
    assert "timed out waiting for the worker to idle" in message
    assert "(deadline 0.05 s)" in message and "checks" in message
    assert "the condition last returned 0" in message


def test_a_timeout_includes_describe_called_once():
    calls = []

    def describe():
        calls.append(1)
        return {"num_running": 3, "num_waiting": 1}

    with pytest.raises(AssertionError, match=r"state at the timeout:\n  num_running: 3\n"):
        wait_until(lambda: False, "every room to run", 0.05, poll_s=0.01, describe=describe)
    assert calls == [1]


def test_a_describe_that_raises_does_not_hide_the_timeout():
    def describe():
        raise ConnectionError("worker gone")

    with pytest.raises(AssertionError) as info:
        wait_until(lambda: False, "the prefill", 0.02, poll_s=0.01, describe=describe)
    assert "timed out waiting for the prefill" in str(info.value)
    assert "describe() raised ConnectionError: worker gone" in str(info.value)


def test_retried_exceptions_count_as_not_yet_and_the_last_one_is_reported():
    attempts = itertools.count()

    def flaky():
        if next(attempts) < 2:
            raise ConnectionError("still starting")
        return True

    assert wait_until(flaky, "the server", 5, poll_s=0, retry_on=(ConnectionError,))
    with pytest.raises(AssertionError, match="last raised ConnectionError: refused"):
        wait_until(_refuse, "the server", 0.02, poll_s=0.01, retry_on=(ConnectionError,))


def test_other_exceptions_propagate_at_once_noting_what_was_awaited():
    with pytest.raises(KeyError) as info:
        wait_until(lambda: {}["num_prefilling"], "the prefill to start", 5)
    assert "(raised while waiting for the prefill to start)" in info.value.__notes__


def _refuse():
    raise ConnectionError("refused")
