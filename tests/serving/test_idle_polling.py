"""After the last call in flight is answered the event loop polls its sockets (select with no wait)
for the window, then blocks again; a call coming in ends the polling; a window of 0 blocks at once."""
from __future__ import annotations

import asyncio
import selectors
import time

from kubetrt.serving import idle_polling


class RecordingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The loop's own selector, recording the timeout of each wait."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def select(self, timeout: float | None = None):  # type: ignore[no-untyped-def]
        self.timeouts.append(timeout)
        return super().select(timeout)


def run(scenario) -> RecordingSelector:  # type: ignore[no-untyped-def]
    selector = RecordingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        loop.run_until_complete(scenario(selector))
    finally:
        loop.close()
    return selector


def test_the_loop_polls_for_the_window_after_the_last_answer_then_blocks():
    async def scenario(selector: RecordingSelector) -> None:
        polling = idle_polling.of_running_loop()
        polling.enter()
        polling.enter()
        polling.leave(0.02)  # one call still in flight: no polling
        assert not polling.polling
        polling.leave(0.02)
        t0 = time.perf_counter()
        selector.timeouts.clear()
        await asyncio.sleep(0.05)  # the loop's only timer: it blocks once the polling ends
        assert polling.turns > 10 and not polling.polling
        polls = [t for t in selector.timeouts if t == 0]
        assert len(polls) >= polling.turns and time.perf_counter() - t0 >= 0.05
        assert any(t is not None and t > 0.01 for t in selector.timeouts), "it never blocked after the window"

    run(scenario)


def test_a_call_coming_in_ends_the_polling_and_a_zero_window_never_starts_it():
    async def scenario(selector: RecordingSelector) -> None:
        polling = idle_polling.of_running_loop()
        polling.enter()
        polling.leave(10.0)
        await asyncio.sleep(0)
        assert polling.polling
        polling.enter()  # the next call
        for _ in range(3):
            await asyncio.sleep(0)
        assert not polling.polling
        turns = polling.turns
        polling.leave(0.0)
        selector.timeouts.clear()
        await asyncio.sleep(0.02)
        assert polling.turns == turns and not polling.polling
        assert sum(t == 0 for t in selector.timeouts) <= 2, selector.timeouts  # the timer coming due

    run(scenario)
