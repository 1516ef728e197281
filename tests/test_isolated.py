"""msllm.isolated: a function run in a worker process hands back its result, its log lines in order,
its exception with its own type, and keeps the caller's warning filters; a worker that dies is one
UserError line."""
import os
import signal
import warnings

import pytest

from msllm.errors import UserError
from msllm.isolated import run_isolated


def work(n, log):
    for i in range(n):
        log(f"line {i}")
    return {"pid": os.getpid(), "squares": [i * i for i in range(n)]}


def fail(log):
    log("about to fail")
    raise KeyError("no such tensor")


def bad_config(log):
    from msllm.config import ConfigError

    raise ConfigError("run/state.json", "model.hidden_size", "must be a multiple of num_heads")


def warn(log):
    warnings.warn("old api", UserWarning)
    return "warned"


def die(log):
    os.kill(os.getpid(), signal.SIGKILL)


def test_result_and_log_lines_come_back_from_another_process():
    lines = []
    result = run_isolated(work, 4, log=lines.append, what="squares")
    assert result["squares"] == [0, 1, 4, 9] and result["pid"] != os.getpid()
    assert lines == ["line 0", "line 1", "line 2", "line 3"]


def test_the_workers_exception_is_raised_with_its_type():
    lines = []
    with pytest.raises(KeyError, match="no such tensor"):
        run_isolated(fail, log=lines.append, what="failing")
    assert lines == ["about to fail"]


def test_an_error_that_does_not_unpickle_still_arrives_as_one_line():
    with pytest.raises(UserError, match=r"^run/state.json: model.hidden_size: must be a multiple of num_heads$"):
        run_isolated(bad_config, log=print, what="config")


def test_a_worker_that_dies_is_one_line():
    with pytest.raises(UserError, match=r"^dying: the worker process died \(exit code -9\)"):
        run_isolated(die, log=print, what="dying")


def test_the_callers_warning_filters_hold_in_the_worker():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(UserWarning, match="old api"):
            run_isolated(warn, log=print, what="warning")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert run_isolated(warn, log=print, what="warning") == "warned"


# --- a caller that goes away or is interrupted, at each moment: the worker leaves without a word

def slow(n, log):
    import time

    for i in range(n):
        log(f"line {i}")
        time.sleep(0.05)
    return n


def start_worker():
    """A worker started as run_isolated starts it; returns (process, read end of its message pipe)."""
    import json
    import subprocess
    import sys

    from msllm.isolated import _BOOT

    read_fd, write_fd = os.pipe()
    worker = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path), str(write_fd)],
                              stdin=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write_fd,))
    os.close(write_fd)
    return worker, read_fd


def job(fn, *args) -> bytes:
    import pickle

    return pickle.dumps((pickle.dumps(warnings.filters), fn, args))


@pytest.mark.parametrize("sent", [0, 0.5])
def test_a_job_cut_short_ends_the_worker_silently(sent):
    """The caller was interrupted before it wrote the job (nothing arrives: the `EOFError: Ran out of
    input` of issue 31) or while it wrote it (half arrives), then end of input."""
    worker, read_fd = start_worker()
    data = job(work, 3)
    worker.stdin.write(data[:int(len(data) * sent)])
    worker.stdin.close()
    assert worker.wait(timeout=60) == 1 and worker.stderr.read() == b""
    assert os.read(read_fd, 100) == b""  # nothing sent
    os.close(read_fd)


def test_a_caller_gone_while_the_worker_answers_ends_it_silently():
    """The caller stopped reading (it exited): the worker's next message finds no reader."""
    worker, read_fd = start_worker()
    os.close(read_fd)
    worker.stdin.write(job(slow, 5))
    worker.stdin.close()
    assert worker.wait(timeout=60) == 1 and worker.stderr.read() == b""


def answer(n, log):
    return b"x" * n  # no log line: the first write to the caller is the result itself


def test_a_caller_gone_before_the_result_is_written_ends_the_worker_silently():
    worker, read_fd = start_worker()
    os.close(read_fd)
    worker.stdin.write(job(answer, 1 << 20))
    worker.stdin.close()
    assert worker.wait(timeout=60) == 1 and worker.stderr.read() == b""


def children() -> list[int]:
    """Pids of this process's live children (from /proc)."""
    out = []
    for p in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{p}/stat").read()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if p.isdigit() and int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(p))
    return out


def test_ctrl_c_reaches_the_caller_not_the_worker(capfd):
    """SIGINT to the worker (as a terminal sends it to a process group) changes nothing: the worker
    finishes and answers. The caller's own Ctrl-C (raised here from its log callback) stops it, and
    the worker is gone without a word."""
    interrupted = []

    def log(line):
        if line == "line 1" and not interrupted:
            [worker] = children()
            os.kill(worker, signal.SIGINT)
            interrupted.append(worker)

    assert run_isolated(slow, 4, log=log, what="slow") == 4 and interrupted

    def interrupt(line):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_isolated(slow, 50, log=interrupt, what="slow")
    assert children() == []
    assert capfd.readouterr().err == ""
