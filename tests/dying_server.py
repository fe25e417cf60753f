"""``tokenwire serve`` whose hf engine thread fails on cue: test_engine_death's fault injection.

``python -m tests.dying_server serve ARGS`` is ``tokenwire serve ARGS``, but the engine thread's
scheduler raises when it applies a pause of mode "wait" (``POST /pause``). That is outside a
step's own error handling (a failed forward fails only its requests), so the thread ends as an
unexpected fault ends it, with the pause unanswered and whatever else was in flight.
"""

from __future__ import annotations

import sys

from tokenwire.cli import main
from tokenwire.engine.hf.handoff import Command, Emits, Pause
from tokenwire.engine.hf.scheduler import Scheduler

FAULT = "injected fault"


def serve_with_fault() -> int:
    """``tokenwire`` with the fault in place: only in this process, never in a test's own (the
    in-process engines there pause for real)."""
    control = Scheduler._control

    def control_or_fail(self: Scheduler, cmd: Command, emits: Emits) -> None:
        if isinstance(cmd, Pause) and cmd.mode == "wait":
            raise RuntimeError(FAULT)
        control(self, cmd, emits)

    Scheduler._control = control_or_fail  # type: ignore[method-assign]
    return main()


if __name__ == "__main__":
    sys.exit(serve_with_fault())
