"""Training records: one console line, one JSONL row and TensorBoard scalars per log step.

All written in the caller's thread: a full disk costs rows (one warning line while it lasts),
never the run. (tensorboardX's SummaryWriter writes from a thread of its own, which dies on
ENOSPC; its queue then fills and blocks the training loop.)
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.enabled, self.failing = enabled, False
        self.jsonl = self.tb = None
        if enabled:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.summary import scalar

            self._event, self._scalar = Event, scalar

            self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a")
            (Path(run_dir) / "tensorboard").mkdir(exist_ok=True)
            self.tb = EventsWriter(str(Path(run_dir) / "tensorboard" / "events"))

    def log(self, record: dict, line: str | None = None) -> None:
        if not self.enabled:
            return
        try:
            if line:
                say(line, sys.stdout)
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
            step = record.get("step", 0)
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    tag = f"{record.get('kind', 'train')}/{key}"
                    self.tb.write_event(self._event(wall_time=time.time(), step=step, summary=self._scalar(tag, value)))
            self.tb.flush()
        except OSError as e:
            if not self.failing:
                try:  # the console may be a log file on the same full disk
                    info(f"warning: metrics not written ({e.strerror or e}); training goes on")
                except OSError:
                    pass
            self.failing = True
        else:
            self.failing = False

    def close(self) -> None:
        if self.enabled:
            for f in (self.jsonl, self.tb):
                try:
                    f.close()
                except OSError:
                    pass


def info(msg: str) -> None:
    say(msg, sys.stderr)


def say(line: str, stream) -> None:
    """One write for the line and its newline: print() writes them apart, and a Ctrl-C between the
    two glued the next line ("msllm train: interrupted") to a half-ended one."""
    stream.write(line + "\n")
    stream.flush()
