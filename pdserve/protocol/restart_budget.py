"""How often a supervisor may restart what it supervises: at most `max_restarts` restarts
within a sliding window, so a crash loop (a device gone bad, a broken model) ends instead of
restarting forever. Used by a worker for its engine process, by `pdserve launch` for its
children and by the router for its processes. Torch-free."""

from __future__ import annotations

from collections import deque


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def take(self, now: float) -> bool:
        """Spend one restart at `now`; False when the window's budget is used up."""
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True
