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
