"""The engine-loading indicator: one line when the output is no terminal, rich's spinner with
the seconds elapsed on a terminal, gone once the engine is up."""

from __future__ import annotations

import io
import time

from span_workflows.apps.cli.progress import engine_loading


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_one_line() -> None:
    out = io.StringIO()
    with engine_loading(out, "loading the model"):
        pass
    assert out.getvalue() == "span-workflows: loading the model...\n"


def test_a_terminal_gets_a_spinner_that_is_erased() -> None:
    out = _Terminal()
    with engine_loading(out, "loading the model"):
        time.sleep(0.3)
    written = out.getvalue()
    assert "loading the model" in written and "0:00:0" in written
    assert "\x1b[?25h" in written and written.endswith("\x1b[2K")  # cursor back, line erased
