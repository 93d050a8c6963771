"""A stand-in for a torch.distributed ``Work`` in the waiting-thread tests: it completes
when the test says so, as a gloo work completes when its peer's message lands."""

from __future__ import annotations

import threading


class FakeWork:
    """Completes when ``finish()`` is called; ``wait()`` blocks until then (as gloo's) and
    raises ``error`` if one was given; ``waited`` says whether anyone called ``wait()``."""

    def __init__(self, error: str | None = None) -> None:
        self._done = threading.Event()
        self._error = error
        self.waited = False

    def finish(self) -> None:
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        self.waited = True
        self._done.wait(30)
        if self._error is not None:
            raise RuntimeError(self._error)
        return True
