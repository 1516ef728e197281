"""Training records: one console line, one JSONL row and TensorBoard scalars per log step."""
from __future__ import annotations

import json
import sys
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.enabled = enabled
        self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a") if enabled else None
        self.tb = None
        if enabled:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, record: dict, line: str | None = None) -> None:
        if not self.enabled:
            return
        if line:
            print(line, flush=True)
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        step = record.get("step", 0)
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, step)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tb.close()


def info(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
