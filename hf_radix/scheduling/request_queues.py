"""The scheduler's requests by status: each live status has its collection, and a request's status always
names the collection that holds it (`move` changes both, `check` verifies).

The DECODING requests are also kept as arrays (`RunningRows`), so that a steady decode step costs O(1)
Python work; their counters lag until `settle` writes them back, which every change of that collection
does first.
"""

from __future__ import annotations

from collections import deque

from ..memory.radix_tree import IntegrityError
from .request import Req, RequestStatus
from .running_rows import RunningRows
from .schedule_policy import PrefixAwareQueue

WAITING, PREFILLING, DECODING, DRAINING = (
    RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.DECODING, RequestStatus.DRAINING
)


class RequestQueues:
    """WAITING (`waiting`, in serving order), PREFILLING, DECODING (`running`) and DRAINING requests."""

    def __init__(self) -> None:
        self.waiting: deque[Req] | PrefixAwareQueue = deque()
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self.draining: list[Req] = []  # every token launched; waiting for the last results
        self._by_status = {PREFILLING: self.prefilling, DECODING: self.running, DRAINING: self.draining}
        self._rows: RunningRows | None = None  # `running` as arrays

    def __bool__(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.draining)

    def active(self) -> int:
        """Requests holding a row and still computing (PREFILLING or DECODING)."""
        return len(self.running) + len(self.prefilling)

    def admit(self, req: Req, row: int, cached_len: int, host_cached_len: int) -> None:
        """The head of `waiting`, already taken off it, starts prefilling on `row`."""
        req.admit(row, cached_len, host_cached_len)
        self.prefilling.append(req)
        req.check()

    def move(self, req: Req, status: RequestStatus) -> None:
        """Moves a live request to another live status."""
        if req.status is DECODING or status is DECODING:
            self.settle()
        self._by_status[req.status].remove(req)
        req.status = status
        self._by_status[status].append(req)
        req.check()

    def leave(self, req: Req) -> None:
        """Takes a live request out (it is being released)."""
        if req.status is DECODING:
            self.settle()
        self._by_status[req.status].remove(req)

    def clear(self) -> list[Req]:
        """Empties every collection (settled); returns the requests that held a row."""
        self.settle()
        held = [*self.prefilling, *self.running, *self.draining]
        self.waiting.clear()
        for reqs in self._by_status.values():
            reqs.clear()
        return held

    def running_rows(self) -> RunningRows:
        """`running` as arrays, built when the collection changed."""
        if self._rows is None:
            self._rows = RunningRows(list(self.running))
        return self._rows

    def settle(self) -> None:
        """Writes the running requests' pending decode steps into their counters and drops the arrays."""
        rows, self._rows = self._rows, None
        if rows is not None:
            rows.settle()

    def check(self) -> None:
        """Raises IntegrityError unless every request's status names its collection and its lengths hold
        (the running requests' counters are brought up to date; their arrays stay)."""
        if self._rows is not None:
            self._rows.settle()
        for status, reqs in [(WAITING, self.waiting), *self._by_status.items()]:
            for req in reqs:
                if req.status is not status:
                    raise IntegrityError(f"request {req.index} is {req.status.name}, held as {status.name}")
                req.check()
