"""A posted point-to-point transfer on a `PairLink` and how it is waited for: every wait has a
deadline, and a transfer that misses it or fails leaves its link failed and aborted."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from pdserve.transfer.backends.dist.dist_store import LinkError, LinkTimeout, as_timedelta, check_timeout

if TYPE_CHECKING:
    from pdserve.transfer.backends.dist.dist_link import PairLink

_POLL_MAX_SLEEP_S = 1e-4  # a waiter polls only while a transfer is in flight


class PendingTransfer:
    """A posted send or receive; `wait` completes it or fails the link."""

    def __init__(self, link: PairLink, work: dist.Work, operation: str, nbytes: int):
        self._link = link
        self._work = work
        self.operation = operation
        self.nbytes = nbytes

    def wait(self, timeout_s: float) -> None:
        """Block until done: LinkTimeout after `timeout_s`, LinkError if the transfer failed.

        For nccl, on return the caller's current CUDA stream is ordered after the transfer.
        """
        check_timeout(timeout_s)
        started = time.monotonic()
        try:
            if self._link.backend == "nccl":
                completed = _poll(self._work, started + timeout_s, self._link)
                if completed:
                    self._work.wait()  # complete already: only orders the current stream
            else:
                # gloo's send/recv works complete only inside wait(); on a timeout gloo
                # closes the pair, so nothing can arrive later.
                completed = self._work.wait(as_timedelta(timeout_s)) is not False
        except LinkError:
            raise
        except RuntimeError as exc:
            elapsed = time.monotonic() - started
            if "timed out" in str(exc).lower() or elapsed >= timeout_s:
                raise self._timed_out(timeout_s) from exc
            reason = f"{self.operation} of {self.nbytes} bytes failed: {exc}"
            self._link.fail(reason)
            raise LinkError(f"pair {self._link.pair_name!r}: {reason}") from exc
        if not completed:
            raise self._timed_out(timeout_s)

    def _timed_out(self, timeout_s: float) -> LinkTimeout:
        reason = f"{self.operation} of {self.nbytes} bytes did not complete within {timeout_s:g} s"
        self._link.fail(reason)
        return LinkTimeout(f"pair {self._link.pair_name!r}: {reason}; link aborted")


def _poll(work: dist.Work, deadline: float, link: PairLink) -> bool:
    """Wait for `work` without Work.wait(timeout): a timed-out nccl wait is treated as fatal
    by torch's error handling, while aborting the group ourselves is its recovery path. A
    link aborted meanwhile (by another thread) ends the wait at once."""
    sleep_s = 1e-5
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return False
        if link.aborted:
            raise LinkError(f"pair {link.pair_name!r}: the link was aborted ({link.failed})")
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, _POLL_MAX_SLEEP_S)
    return True
