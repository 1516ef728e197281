"""Run under msrun for the data-parallel post-training tests: the `msllm` commands listed in OUT_DIR/commands.json,
one after the other, in this worker's one process (the cluster is joined once; each command is a whole
`msllm train`, as `msllm launch` runs it).

    msrun ... tests/workers.py OUT_DIR ... train_worker   # tests/test_dpo.py's and test_grpo.py's, in conftest's
                                                          # shared launch (msrun_workers)
    msrun ... tests/train_worker.py OUT_DIR               # a launch of its own (conftest's msllm_under_msrun)
"""
import json
import sys
from pathlib import Path

from msllm import cli


def main(out: Path, rank: int = 0, world: int = 1) -> None:
    """rank, world: the caller's (tests/workers.py's interface); each command joins the cluster through msllm."""
    for args in json.loads((out / "commands.json").read_text()):
        if cli.main(args):
            raise RuntimeError(f"msllm {' '.join(args)} failed (its message is above)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
