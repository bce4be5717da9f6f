"""What a test steers and reads on the loopback Hub besides its repos: the faults it injects, and the log of the
requests the Hub answered."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field


@dataclass
class FaultRule:
    """Make the next `times` requests matching (method, path_regex) fail with `status`.

    `times=None` means "always". `delay` (seconds) is slept before answering (with the fault status, or
    with the normal answer when `status` is None: a pure slow-down, a stalled Hub when long). `reset=True`
    drops the connection instead of answering (a TCP reset after reading the request): the client sees a
    connection error, not an HTTP status.
    """

    status: int | None = 503
    times: int | None = 1
    path_regex: str | None = None
    method: str | None = None
    delay: float = 0.0
    message: str = "Injected fault"
    reset: bool = False
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.method is not None and self.method.upper() != method.upper():
            return False
        if self.path_regex is not None and re.search(self.path_regex, path) is None:
            return False
        return True

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.hits >= self.times


@dataclass
class RequestRecord:
    """One answered request, as the log keeps it."""

    method: str
    path: str  # path and query string, as sent
    status: int
    user: str | None  # user of the bearer token (None if no/invalid token)
    user_agent: str
    client: tuple  # (host, port) of the client socket
    time: float = field(default_factory=time.time)
    faulted: bool = False
    client_pid: int | None = None  # the process that holds the client socket, when HubServer.identify_clients is on


class Faults:
    """The injected fault rules: a request takes the first rule it matches (HubServer.inject_faults)."""

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self._rules: list[FaultRule] = []

    def add(self, rule: FaultRule) -> FaultRule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def take(self, method: str, path: str) -> FaultRule | None:
        """The first rule this request matches, counted as hit; None when no rule matches."""
        with self._lock:
            for rule in self._rules:
                if rule.matches(method, path):
                    rule.hits += 1
                    return rule
        return None


class RequestLog:
    """The requests answered since the last clear(), each logged once its answer is sent.

    A client may read its answer before the handler logs it, so the log is read only once no request is in flight
    (else a test asserting right after a request could see it missing). A request begun before clear() (a stalled
    one from an earlier test) belongs to an older generation: it is neither waited for nor logged.
    """

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self._records: list[RequestRecord] = []
        self._in_flight = 0
        self._generation = 0
        self._settled = threading.Condition(lock)

    def records(self) -> list[RequestRecord]:
        """The log, once the requests in flight are answered (or after 10 s)."""
        with self._lock:
            self._settled.wait_for(lambda: self._in_flight == 0, timeout=10)
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self._generation += 1
            self._in_flight = 0

    def begin(self) -> int:
        """Count a request in flight; returns the log generation it belongs to."""
        with self._lock:
            self._in_flight += 1
            return self._generation

    def add(self, record: RequestRecord, generation: int) -> None:
        """Log a request once it is answered, and mark it no longer in flight (if the log was not cleared since)."""
        with self._lock:
            if generation != self._generation:
                return
            self._records.append(record)
            self._in_flight -= 1
            self._settled.notify_all()
