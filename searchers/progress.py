"""A progress bar for long searches: shown only when a search runs longer than ``delay`` seconds.

The bar is drawn by ``rich`` (imported only when a bar is shown) on standard error, and is
transient: it disappears when the search ends. It is drawn on an interactive terminal and in Jupyter
with ``ipywidgets``; elsewhere (a plain log, a notebook without ipywidgets, where rich's live display
cannot draw) the search writes one line on standard error when it has run ``delay`` seconds and one
when it ends. Never under pytest (``PYTEST_CURRENT_TEST`` is set), and never when the environment
variable ``MSHARD_PROGRESS`` is ``0`` (``1`` forces it on).

>>> with Progress("searching", total=3, enabled=False) as bar:
...     bar.advance(3)
>>> bar.shown
False
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any


def progress_enabled() -> bool:
    """Whether a bar may be shown here (see the module doc)."""
    flag = os.environ.get("MSHARD_PROGRESS", "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        return True
    return "PYTEST_CURRENT_TEST" not in os.environ


def _can_draw() -> bool:
    """Whether rich can draw a live bar here: a terminal, or Jupyter with ipywidgets."""
    if "ipykernel" in sys.modules:
        import importlib.util
        return importlib.util.find_spec("ipywidgets") is not None
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """A delayed, transient progress bar (a context manager).

    ``total=None`` shows a spinner with the elapsed time. ``advance`` and ``update`` are cheap
    when no bar is shown. ``console`` (a ``rich.console.Console``) is for tests.
    """

    def __init__(self, description: str, total: float | None = None, *, enabled: bool | None = None,
                 delay: float = 1.0, console: Any = None) -> None:
        self.description, self.total, self.delay, self.console = description, total, delay, console
        self.enabled = progress_enabled() if enabled is None else enabled
        self.completed = 0.0
        self.shown = False
        self._bar: Any = None
        self._task: Any = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._lines: float | None = None      # line mode: when the search started

    def __enter__(self) -> Progress:
        if self.enabled:
            if self.delay <= 0:
                self._start()
            else:
                self._timer = threading.Timer(self.delay, self._start)
                self._timer.daemon = True
                self._timer.start()
        return self

    def _start(self) -> None:
        with self._lock:
            if self._closed or self._bar is not None:
                return
            if self.console is None and not _can_draw():
                self._lines = time.perf_counter() - self.delay
                print(f"mshard: {self.description}: searching ...", file=sys.stderr, flush=True)
                self.shown = True
                return
            from rich.console import Console
            from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress
            console = self.console or Console(stderr=True)
            cols = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed:.0f}/{task.total:.0f}") if self.total else TextColumn(""),
                    TimeElapsedColumn()]
            self._bar = RichProgress(*cols, console=console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, completed=self.completed)
            self.shown = True

    def advance(self, n: float = 1.0) -> None:
        self.completed += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.completed)

    def update(self, *, completed: float | None = None, total: float | None = None,
               description: str | None = None) -> None:
        if completed is not None:
            self.completed = completed
        if total is not None:
            self.total = total
        if description is not None:
            self.description = description
        if self._bar is not None:
            self._bar.update(self._task, completed=self.completed, total=self.total, description=self.description)

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._bar is not None:
                self._bar.stop()
            if self._lines is not None:
                print(f"mshard: {self.description}: done in {time.perf_counter() - self._lines:.1f} s",
                      file=sys.stderr, flush=True)
