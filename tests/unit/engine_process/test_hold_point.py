"""The tests' hold point (`engine_process/hold_point.py`): armed only by its variable, it stops
the loop once, at a request part-way through its prompt, until released."""

from __future__ import annotations

import threading

import pytest

from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine_process import hold_point
from pdserve.engine_process.hold_point import ENV, HoldPoint
from tests.waiting import wait_until


def _request(computed: int, status=RequestStatus.RUNNING) -> Request:
    request = Request("r-1", [5] * 8, SamplingParams(), max_total_tokens=16)
    request.num_computed_tokens, request.status = computed, status
    return request


def test_unset_it_is_not_armed(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert HoldPoint.from_env() is None


@pytest.mark.parametrize(
    ("spec", "match"),
    [("prefill-started", "POINT:DIRECTORY"), ("later:/tmp", "unknown hold point 'later'")],
)
def test_a_bad_setting_is_refused_naming_it(monkeypatch, spec, match):
    monkeypatch.setenv(ENV, spec)
    with pytest.raises(ValueError, match=match):
        HoldPoint.from_env()


def test_it_passes_requests_that_are_not_mid_prefill(tmp_path):
    (tmp_path / "armed").touch()
    hold = HoldPoint("prefill-started", str(tmp_path))
    hold.after_step([_request(0), _request(8), _request(4, RequestStatus.WAITING)])
    assert not (tmp_path / "held").exists() and not hold.spent


def test_it_holds_nothing_until_armed(tmp_path):
    hold = HoldPoint("prefill-started", str(tmp_path))
    hold.after_step([_request(4)])
    assert not (tmp_path / "held").exists() and not hold.spent


def test_it_holds_once_mid_prefill_until_released(tmp_path, monkeypatch):
    monkeypatch.setattr(hold_point, "HOLD_DEADLINE_S", 30.0)
    hold = HoldPoint("prefill-started", str(tmp_path))
    (tmp_path / "armed").touch()
    stepping = threading.Thread(target=hold.after_step, args=([_request(4)],))
    stepping.start()
    wait_until((tmp_path / "held").exists, "the hold to be reached")
    assert (tmp_path / "held").read_text() == "r-1"
    assert stepping.is_alive()  # held, nothing released it
    (tmp_path / "release").touch()
    stepping.join(5)
    assert not stepping.is_alive()
    hold.after_step([_request(4)])  # spent: never holds twice
