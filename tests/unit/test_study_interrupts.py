"""Ctrl-C during the search is remembered and handed to Tune's own stop (pipeline/study/interrupts.py).

Real signals to this process; a stand-in for Tune's SIGUSR1 handler records that the stop reached it.
"""

from __future__ import annotations

import os
import signal

import pytest

from pipeline.study.interrupts import watching_interrupts


def test_a_ctrl_c_is_remembered_and_reaches_tunes_stop_handler():
    reached_tune = []
    before, env_before = signal.getsignal(signal.SIGINT), os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    with watching_interrupts() as interrupted:
        assert os.environ["TUNE_DISABLE_SIGINT_HANDLER"] == "1"  # Tune keeps its hands off SIGINT during fit()
        signal.signal(signal.SIGUSR1, lambda signum, frame: reached_tune.append(signum))  # as Tune's fit() does
        assert not interrupted.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupted.is_set() and reached_tune == [signal.SIGUSR1]
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: stop now, as Tune's own message promises
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    assert os.environ.get("TUNE_DISABLE_SIGINT_HANDLER") == env_before


def test_a_ctrl_c_before_tune_listens_interrupts_as_usual_instead_of_killing_the_process():
    # SIGUSR1's default action ends the process: with no Tune handler yet, the Ctrl-C must stay a KeyboardInterrupt.
    with watching_interrupts() as interrupted:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert not interrupted.is_set()
