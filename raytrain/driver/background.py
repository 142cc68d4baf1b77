"""Work started now and waited for later, in a daemon thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    """Run ``fn`` in a daemon thread; ``result()`` waits, then returns its value or raises
    its exception in the caller's thread."""

    def __init__(self, fn: Callable[[], Any]):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # re-raised by result()
            self._error = exc

    def result(self, timeout: float | None = None) -> Any:
        """The value; raises ``TimeoutError`` if ``fn`` is still running after ``timeout``."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value
