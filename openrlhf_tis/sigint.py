"""Every command's SIGINT, taken back where a script's `cmd &` left it ignored.

At the bottom because every layer has a command (the training CLI, the pipeline, the study, the dashboard, the run
store's reader, the calibration command), and each calls `take_sigint` first thing in its main.
"""

from __future__ import annotations

import signal

INTERRUPTED_EXIT = 130  # a shell's code for a command ended by SIGINT


def take_sigint() -> None:
    """Make SIGINT (Ctrl-C, `kill -INT`) raise KeyboardInterrupt, which every command turns into its documented stop.

    Python installs that handler only where SIGINT was not ignored when it started, and a shell script starts its
    background jobs (`openrlhf-tis-train ... &`) with SIGINT ignored: `kill -INT` then did nothing. Call it from the
    main thread, first thing in a command's main."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
