"""Ctrl-C during the search: Tune stops quietly and returns as if it had finished; the driver must still know.

Tune turns the first SIGINT into "stop after saving state" and returns a normal result grid. Whether a trial was left
unfinished shows in Tune's checkpoint, but a Ctrl-C that lands between two trials leaves none unfinished, and the
driver would then finalize a study the user stopped. `watching_interrupts` remembers the Ctrl-C itself and hands the
stop to Tune through the signal Tune also listens on (SIGUSR1), so Tune's own save-and-stop path is unchanged.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def watching_interrupts() -> Iterator[threading.Event]:
    """Yield an event set by a Ctrl-C while the block runs; a second Ctrl-C raises KeyboardInterrupt at once.

    Off the main thread (signals cannot be caught there) the event is never set and Tune keeps its own handler.
    """
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        yield interrupted
        return

    def on_interrupt(signum: int, frame: object) -> None:
        # Before Tune has set up (SIGUSR1 still default, which would kill the process) or on a second Ctrl-C: as usual.
        if interrupted.is_set() or signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.SIG_IGN, None):
            raise KeyboardInterrupt
        interrupted.set()
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's stop handler (registered on SIGUSR1 whatever the env says)

    previous_handler = signal.signal(signal.SIGINT, on_interrupt)
    # a handler left by an earlier fit() in this process would take the stop for a run that is over
    previous_usr1 = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    previous_env = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # else Tune's SIGINT handler replaces ours during fit()
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        signal.signal(signal.SIGUSR1, previous_usr1)
        if previous_env is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = previous_env
