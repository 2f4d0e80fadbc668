"""Ctrl-C while the `dflash-native` command starts up (its package still importing) ends it as
Ctrl-C later does: exit status 130, one line on stderr, no KeyboardInterrupt traceback. Only for the
command: a program that imports the package keeps its KeyboardInterrupt.

The console script imports dflash_native.cli (and with it the package: _core, numpy, the engine)
before cli.main's handlers run, so the package's __init__ and cli.py catch KeyboardInterrupt around
their imports (their first statement is the `try`, so that nothing of theirs runs unguarded) and
call interrupted_import()."""

from __future__ import annotations

import os
import signal
import sys


def launched_as_command() -> bool:
    """True in the `dflash-native` console script and in `python -m dflash_native`."""
    main = sys.modules.get("__main__")
    if os.path.basename(getattr(main, "__file__", None) or "").startswith("dflash-native"):
        return True  # the script pip writes: dflash-native (dflash-native-script.py on Windows)
    argv = list(getattr(sys, "orig_argv", []))
    return "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["dflash_native"]


def ignore_further_interrupts() -> None:
    """After the first Ctrl-C the command is ending: another one would interrupt the exit itself
    (and print its traceback). Only in the command's main thread."""
    if launched_as_command():
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass


def interrupted_import() -> None:
    """In `except KeyboardInterrupt:` around a module's imports: under the command, a line and exit
    130; elsewhere it returns (and the caller re-raises)."""
    if launched_as_command():
        exit_interrupted()


def exit_interrupted() -> None:
    """The command was interrupted while importing: a line, exit 130 (nothing is running yet
    that would need Python's shutdown)."""
    ignore_further_interrupts()
    try:
        sys.stderr.write("\ndflash-native: interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # a closed stderr
        pass
    os._exit(130)
