"""Run one function in a fresh Python process and hand back its result, its log lines and its errors.

For work whose memory MindSpore never returns to the OS (a graph compiled for ms.export keeps the
weights it saw until the process ends): the process that did the work ends with it, so the next
stage starts from an empty heap. The worker is a new interpreter (a fork would copy MindSpore's
threads; multiprocessing's spawn would re-run the caller's script), gets the caller's sys.path and
warning filters, streams log lines back through a pipe as they come, and its exception is raised
here with its own type; a worker that dies without a word becomes a UserError.

Ctrl-C belongs to the caller: the worker ignores SIGINT (a terminal sends it to the whole process
group) and the caller kills it on its way out. A worker whose caller is gone, at any moment (before
the job arrived, while it works, while it answers), leaves silently: nobody is left to tell.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import traceback
import warnings
from typing import Callable

from msllm.errors import UserError

_BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
         "from msllm.isolated import serve; serve(int(sys.argv[2]))")


def serve(fd: int) -> None:
    """The worker's side: (pickled warning filters, fn, args) from stdin; ("log" | "ok" | "error", value) to fd."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(fd, "wb")

    def send(kind, value):
        try:
            pickle.dump((kind, value), out)
            out.flush()
        except OSError:  # the caller is gone (BrokenPipeError): nobody to tell
            os._exit(1)

    try:
        try:
            filters, fn, args = pickle.load(sys.stdin.buffer)
        except (EOFError, pickle.UnpicklingError):  # cut short: the caller went away before the job arrived
            os._exit(1)
        try:
            warnings.filters[:] = pickle.loads(filters)
        except Exception:  # a warning class of the caller's own script: the defaults, then
            pass
        send("ok", fn(*args, log=lambda line: send("log", line)))
    except BaseException as e:  # noqa: BLE001 -- every failure goes back to the caller, with its type
        e.add_note("in the worker process:\n" + "".join(traceback.format_tb(e.__traceback__)).rstrip())
        send("error", portable(e))
    try:
        out.close()
    except OSError:
        os._exit(1)


def portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling both ways (an exception whose __init__ takes other arguments than
    its message does not), else one of its message: a UserError for a UserError, so the CLI still
    prints one line."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return (UserError if isinstance(e, UserError) else RuntimeError)(str(e) or type(e).__name__)


def run_isolated(fn: Callable, *args, log: Callable[[str], None], what: str):
    """fn(*args, log=...) in a new Python process; returns what it returns. fn and args must pickle;
    `what` names the work in the message if the process dies (killed, out of memory)."""
    read_fd, write_fd = os.pipe()
    # Its own session: a terminal's Ctrl-C reaches only the caller, which then kills the worker.
    worker = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path), str(write_fd)],
                              stdin=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)  # the worker holds the only writer: reading ends with EOFError when it is gone
    finished = False
    try:
        try:
            with worker.stdin:
                pickle.dump((pickle.dumps(warnings.filters), fn, args), worker.stdin)
        except BrokenPipeError:  # it died at start: reading below says so
            pass
        with os.fdopen(read_fd, "rb") as messages:
            while True:
                try:
                    kind, value = pickle.load(messages)
                except EOFError:
                    raise UserError(f"{what}: the worker process died (exit code {worker.wait()}); out of "
                                    f"memory? see dmesg") from None
                if kind == "log":
                    log(value)
                    continue
                finished = True
                if kind == "ok":
                    return value
                raise value
    finally:  # on Ctrl-C here too: the worker stops before the caller cleans up what it was writing
        if not finished:
            worker.kill()
        worker.wait()
