"""The demo's progress lines on stderr: a bar redrawn in place on a terminal, one plain
line per step anywhere else (a log file gets no carriage returns)."""

from __future__ import annotations

from typing import TextIO

__all__ = ["BAR_WIDTH", "Progress"]

BAR_WIDTH = 20


class Progress:
    """Progress of ``total`` steps written to ``stream``, each ``label done/total text``.

    On a terminal (``stream.isatty()``) each call redraws one line in place (``\\r``) and
    ``close`` ends it; elsewhere each call writes a line of its own and ``close`` writes
    nothing.
    """

    def __init__(self, stream: TextIO, total: int, *, label: str = "step") -> None:
        self._stream = stream
        self._total = total
        self._label = label
        self._terminal = stream.isatty()

    @property
    def terminal(self) -> bool:
        return self._terminal

    def show(self, done: int, text: str) -> None:
        """Report ``done`` of the steps, with ``text`` after the count."""
        line = f"{self._label} {done}/{self._total} {text}"
        if self._terminal:
            bar = "#" * (BAR_WIDTH * done // self._total)
            self._stream.write(f"\r  [{bar:<{BAR_WIDTH}}] {line}")
        else:
            self._stream.write(f"  {line}\n")
        self._stream.flush()

    def close(self) -> None:
        """End the bar's line (on a terminal)."""
        if self._terminal:
            self._stream.write("\n")
            self._stream.flush()
