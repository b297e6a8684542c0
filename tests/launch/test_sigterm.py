"""SIGTERM in the controller: Terminated raised in the main thread, and exit code 143 even when
a library between the signal and the controller re-raises it as a plain KeyboardInterrupt."""
import os
import signal
import time

import pytest

from megaflow.launch.failures import RunInterrupted, Terminated, exit_code_of, sigterm_received, stop_cleanly_on_sigterm


def test_a_rewrapped_sigterm_still_exits_143():
    previous = stop_cleanly_on_sigterm()
    try:
        assert not sigterm_received() and exit_code_of(KeyboardInterrupt()) == 130  # Ctrl-C
        with pytest.raises(KeyboardInterrupt) as caught:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here at the latest
            except Terminated:
                raise KeyboardInterrupt from None  # what a library catching and re-raising does
        assert type(caught.value) is KeyboardInterrupt and sigterm_received()
        assert exit_code_of(caught.value) == 143
        assert exit_code_of(RunInterrupted(step=3, checkpoint=None)) == 143
        stop_cleanly_on_sigterm()  # a new run in this process starts without it
        assert not sigterm_received() and exit_code_of(KeyboardInterrupt()) == 130
        stop_cleanly_on_sigterm(reset=False)  # re-installed within a run: remembered
    finally:
        signal.signal(signal.SIGTERM, previous)
