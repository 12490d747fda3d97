"""The event loop keeps polling its sockets for a short while after it answers the last call in
flight, instead of blocking in the kernel at once.

Why: a thread blocked in epoll is woken by the next request through the scheduler, and on a
virtual machine whose CPU went idle, through an interrupt to it: that costs more than a small
model's whole run. A client that sends its next request as soon as it has the answer sends it
within tens of microseconds, while the loop still polls. The polling stops when a call comes in
(its run needs the cores) or the window ends; under load calls overlap and it seldom starts.
"""
from __future__ import annotations

import asyncio
import time
import weakref


class IdlePolling:
    """One event loop's calls in flight, and its polling after the last one is answered."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.calls = 0
        self.until = 0.0
        self.polling = False
        self.turns = 0  # loop turns spent polling, for tests and curiosity

    def enter(self) -> None:
        self.calls += 1

    def leave(self, window_s: float) -> None:
        self.calls -= 1
        if self.calls or window_s <= 0:
            return
        self.until = time.perf_counter() + window_s
        if not self.polling:
            self.polling = True
            self.loop.call_soon(self._turn)

    def _turn(self) -> None:
        # A callback ready to run makes the loop poll its sockets without blocking, then run it.
        if self.calls == 0 and time.perf_counter() < self.until:
            self.turns += 1
            self.loop.call_soon(self._turn)
        else:
            self.polling = False


_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, IdlePolling] = weakref.WeakKeyDictionary()


def of_running_loop() -> IdlePolling:
    loop = asyncio.get_running_loop()
    polling = _BY_LOOP.get(loop)
    if polling is None:
        polling = _BY_LOOP[loop] = IdlePolling(loop)
    return polling
