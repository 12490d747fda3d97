"""Running one piece of test work on several threads at once, their failures raised here."""
from __future__ import annotations

import threading
from typing import Any, Callable


def on_threads(work: Callable[[Any], None], args: list[Any]) -> None:
    """work(arg) for each arg, all on their own threads at once; the first failure is raised."""
    errors: list[BaseException] = []

    def guarded(arg: Any) -> None:
        try:
            work(arg)
        except BaseException as e:  # noqa: BLE001 - raised below, on the test's thread
            errors.append(e)
    threads = [threading.Thread(target=guarded, args=(arg,)) for arg in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
