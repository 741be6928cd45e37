"""The project's own errors: what `rollctl` prints as one line (`rollctl: error: ...`).

An error of one of these classes is raised on purpose, for a cause a person can act on (a config
key, a file, a Redis URL, a model path), and its message names the cause and the fix, so that
line is the whole story. Any other exception is a bug or a failure nobody foresaw, and `rollctl`
prints its traceback (`rollctl --debug` prints it for these too). Stdlib only, so every folder of
the project may import it.
"""

from __future__ import annotations


class RollflashError(Exception):
    """An error a person can act on; the first line of its message names the cause and the fix."""


class MissingFile(RollflashError, FileNotFoundError):
    """A file or directory a person named (a model, a checkpoint, a data file) is not there."""


class BadInput(RollflashError, ValueError):
    """A value a person gave, outside the config file (an option, a row of a data file, a task
    parameter), is wrong; the message names it."""


class RunDirInUse(RollflashError, FileExistsError):
    """A run directory holds what another run left there (weights without a checkpoint)."""


class Stopped(BaseException):
    """A process stopped on a signal (SIGTERM, SIGINT) and ended cleanly: `rollctl` prints its
    message as one line and exits with 128 + the signal's number, as a shell reports a process a
    signal ended (130 for SIGINT, 143 for SIGTERM). A BaseException, as KeyboardInterrupt is, so
    that no `except Exception` of the code it interrupts catches it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
