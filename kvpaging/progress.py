"""Progress bars that leave their final state behind in a saved notebook.

``tqdm.auto`` draws a widget in Jupyter. A notebook saved without widget state (as the
lessons are, to stay small) keeps only the widget's first text, "0%|  | 0/3", so every
saved lesson showed unfinished bars. Here, inside a Jupyter kernel, a bar is a plain
display (HTML with a text fallback) that is redrawn in place at most a few times a second
and once more when it closes: what is saved is the finished bar, with its time and rate.
Outside Jupyter it is an ordinary ``tqdm`` bar on stderr.

    bar = progress_bar(total=3, desc="Processed prompts", unit="req")
    bar.update(1); ...; bar.close()
    for x in track(items, desc="batch sizes"): ...
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress_bar", "track", "in_notebook"]

T = TypeVar("T")
_REDRAW_S = 0.25  # the shortest time between two redraws in a notebook


def in_notebook() -> bool:
    """True inside a Jupyter kernel (not in a terminal IPython, not in plain Python)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class _Disabled:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class NotebookBar:
    """A progress bar drawn as one notebook output, redrawn in place (see the module docstring)."""

    def __init__(self, total: int | None, desc: str = "", unit: str = "it") -> None:
        from IPython.display import display

        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.postfix = ""
        self.closed = False
        self._start = self._drawn = time.perf_counter()
        self._handle = display(self, display_id=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self._drawn >= _REDRAW_S:
            self._drawn = now
            self._handle.update(self)

    def set_postfix_str(self, text: str) -> None:
        """A note after the figures (what is running now), as tqdm's ``set_postfix_str``."""
        self.postfix = text
        self._handle.update(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._elapsed = time.perf_counter() - self._start
            self._handle.update(self)

    def _figures(self) -> tuple[str, float | None]:
        elapsed = self._elapsed if self.closed else time.perf_counter() - self._start
        rate = f", {self.n / elapsed:.2f} {self.unit}/s" if elapsed > 0 and self.n else ""
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        fraction = self.n / self.total if self.total else None
        postfix = f", {self.postfix}" if self.postfix else ""
        return f"{count} [{elapsed:.1f} s{rate}{postfix}]", fraction

    def __repr__(self) -> str:
        figures, fraction = self._figures()
        percent = f"{fraction:4.0%} " if fraction is not None else ""
        return f"{self.desc}: {percent}{figures}"

    def _repr_html_(self) -> str:
        figures, fraction = self._figures()
        bar = (f'<progress value="{self.n}" max="{self.total}" style="width: 14em; vertical-align: middle"></progress> '
               if fraction is not None else "")
        percent = f"{fraction:.0%} " if fraction is not None else ""
        return (f"<div style=\"font-family: monospace\">{html.escape(self.desc)}: {bar}{percent}"
                f"{html.escape(figures)}</div>")


def progress_bar(total: int | None = None, desc: str = "", unit: str = "it", disable: bool = False):
    """A bar with ``update(n)``, ``set_postfix_str(text)`` and ``close()``: a :class:`NotebookBar` in
    Jupyter, ``tqdm`` elsewhere."""
    if disable:
        return _Disabled()
    if in_notebook():
        return NotebookBar(total, desc, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)


def track(iterable: Iterable[T], desc: str = "", unit: str = "it", total: int | None = None,
          disable: bool = False) -> Iterator[T]:
    """Iterate over ``iterable`` with a progress bar (``total`` defaults to ``len(iterable)`` when it has one)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    bar = progress_bar(total, desc, unit, disable)
    try:
        for item in iterable:
            yield item
            bar.update(1)
    finally:
        bar.close()
