"""What `exgrpo train` prints survives the end of its readers: a closed stdout or stderr never stops a run.

`exgrpo train ... 2>&1 | tee run.log` is how a training log is usually kept, and a terminal's Ctrl-C goes to every
process of that command line: `tee` dies at once, and the trainer's next write to the pipe raised `BrokenPipeError`,
which ended the run before the interrupt's checkpoint was saved, with no message (the message had nowhere to go
either). Here `sys.stdout` and `sys.stderr` are wrapped (`SurvivingStream`) for the whole command: a write to a closed
pipe or file is dropped, and everything written is also appended to the command's own log file when one is given
(``--log_file``), which no pipe can lose. The command's last line (where it stopped, how to go on: `tell`) goes to
stderr, to the log file, and, when the pipe the user was reading has lost its reader, to the terminal the command was
started from (``/dev/tty``), where the user typed Ctrl-C. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
from typing import IO

# what writing to a stream whose reader is gone (or that was closed) raises
_GONE = (BrokenPipeError, ConnectionResetError, ValueError)
_GONE_ERRNOS = (errno.EPIPE, errno.EBADF, errno.ECONNRESET)


def _gone(error: BaseException) -> bool:
    if isinstance(error, _GONE):
        return True
    return isinstance(error, OSError) and error.errno in _GONE_ERRNOS


class SurvivingStream:
    """A text stream that never raises because its reader is gone: `write` and `flush` to a closed pipe or file are
    dropped from then on (`broken`), and what is written is also appended to `copy` (a log file) first, if set."""

    def __init__(self, stream: IO[str] | None):
        self.stream = stream
        self.broken = stream is None  # a process started with the descriptor closed has sys.stdout None
        self.copy: IO[str] | None = None

    def write(self, text: str) -> int:
        if self.copy is not None:
            try:
                self.copy.write(text)
                self.copy.flush()
            except OSError:
                self.copy = None  # a full disk: the log file stops, the run goes on
        if not self.broken:
            try:
                self.stream.write(text)
            except Exception as e:
                if not _gone(e):
                    raise
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if self.broken:
            return
        try:
            self.stream.flush()
        except Exception as e:
            if not _gone(e):
                raise
            self.broken = True

    def isatty(self) -> bool:
        return not self.broken and self.stream.isatty()

    def __getattr__(self, name):  # encoding, fileno, buffer, ...: the wrapped stream's
        return getattr(self.stream, name)


class Output:
    """The command's two wrapped streams (`surviving_output`), its log file and its last word (`tell`)."""

    def __init__(self, stdout: SurvivingStream, stderr: SurvivingStream):
        self.stdout, self.stderr = stdout, stderr
        self.log_file: IO[str] | None = None

    def also_to(self, path: str | os.PathLike | None) -> None:
        """Append everything printed from now on to `path` (made if missing); on the main process only (`RANK`
        unset or 0): the other ranks' output is theirs."""
        if path is None or self.log_file is not None or int(os.environ.get("RANK", "0") or 0) != 0:
            return
        path = os.path.expanduser(os.fspath(path))
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.log_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed when the command ends)
        self.stdout.copy = self.stderr.copy = self.log_file

    def tell(self, line: str) -> None:
        """The command's last line: to stderr (and the log file), and to the terminal when what the user was
        reading there lost its reader (`exgrpo train ... 2>&1 | tee log`, or `2>err.log | tee log`, after Ctrl-C
        killed tee) and stderr is not that terminal itself."""
        print(line, file=self.stderr, flush=True)
        if self.stderr.broken or (self.stdout.broken and not self.stderr.isatty()):
            to_terminal(line)

    def close(self) -> None:
        if self.log_file is not None:
            self.stdout.copy = self.stderr.copy = None
            self.log_file.close()
            self.log_file = None


def to_terminal(line: str) -> bool:
    """Write `line` to the controlling terminal (``/dev/tty``), if the process has one; whether it was written."""
    try:
        with open("/dev/tty", "w", encoding="utf-8") as tty:
            tty.write(line + "\n")
        return True
    except OSError:
        return False


def _repoint_log_handlers(old, new) -> None:
    """Logging handlers made before the streams were wrapped (transformers' and datasets' own, at import) write to the
    wrapped stream instead."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is old:
                handler.stream = new
                handler.__dict__.pop("flush", None)  # transformers binds the old stream's flush to its handler


@contextlib.contextmanager
def surviving_output():
    """`sys.stdout` and `sys.stderr` wrapped in `SurvivingStream`s for the block (logging handlers that write to them
    included), restored after it; yields the `Output`. A descriptor whose reader went away is then pointed at
    /dev/null, so that the interpreter's last flush at exit does not fail on it either."""
    old_out, old_err = sys.stdout, sys.stderr
    output = Output(SurvivingStream(old_out), SurvivingStream(old_err))
    sys.stdout, sys.stderr = output.stdout, output.stderr
    _repoint_log_handlers(old_out, output.stdout)
    _repoint_log_handlers(old_err, output.stderr)
    try:
        yield output
    finally:
        for wrapped in (output.stdout, output.stderr):
            with contextlib.suppress(Exception):
                wrapped.flush()
        sys.stdout, sys.stderr = old_out, old_err
        _repoint_log_handlers(output.stdout, old_out)
        _repoint_log_handlers(output.stderr, old_err)
        output.close()
        for wrapped in (output.stdout, output.stderr):
            if wrapped.broken and wrapped.stream is not None:
                _silence(wrapped.stream)


def _silence(stream) -> None:
    """Point `stream`'s descriptor at /dev/null (what it still buffers is dropped there)."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    except OSError:
        pass
    finally:
        os.close(devnull)
