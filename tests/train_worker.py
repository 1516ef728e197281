"""Run under msrun by the data-parallel post-training tests (tests/test_dpo.py, tests/test_grpo.py): the
`msllm` commands listed in OUT_DIR/commands.json, one after the other, in this worker's one process (the
cluster is joined once; each command is a whole `msllm train`, as `msllm launch` runs it).

    msrun ... tests/train_worker.py OUT_DIR
"""
import json
import sys
from pathlib import Path

if __name__ == "__main__":
    from msllm.cli import main

    for args in json.loads((Path(sys.argv[1]) / "commands.json").read_text()):
        code = main(args)
        if code:
            sys.exit(code)
