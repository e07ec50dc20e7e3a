"""A supervisor (a worker for its engine, `pdserve launch` for its children) restarts within
a budget per sliding time window."""

from __future__ import annotations

from pdserve.protocol.restart_budget import RestartBudget


def test_restart_budget_allows_max_restarts_within_the_window():
    budget = RestartBudget(max_restarts=2, window_s=10.0)
    assert budget.take(0.0)
    assert budget.take(1.0)
    assert not budget.take(2.0)


def test_restart_budget_refills_as_old_restarts_leave_the_window():
    budget = RestartBudget(max_restarts=2, window_s=10.0)
    assert budget.take(0.0) and budget.take(5.0)
    assert not budget.take(9.0)
    assert budget.take(10.5)  # the restart at 0.0 left the window
    assert not budget.take(11.0)


def test_zero_restarts_means_stop_at_the_first_exit():
    assert not RestartBudget(max_restarts=0, window_s=10.0).take(0.0)
