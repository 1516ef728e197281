"""The script msrun starts on every worker (msrun runs `python SCRIPT ARGS`): note this process's
pid by rank, so `msllm launch` can name a worker that dies, then run `msllm ARGS`."""
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    pid_dir = os.environ.get("MSLLM_PID_DIR")
    if pid_dir and "RANK_ID" in os.environ:
        Path(pid_dir, f"rank_{os.environ['RANK_ID']}.pid").write_text(str(os.getpid()))
    from msllm.cli import main

    sys.exit(main(sys.argv[1:]))
