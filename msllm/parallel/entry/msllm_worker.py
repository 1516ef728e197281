"""The script msrun starts on every worker (msrun runs `python SCRIPT ARGS`): note this process's
pid by rank, so `msllm launch` can name a worker that dies, let SIGUSR1 dump its Python stacks
into its log (the launch watchdog asks when it hangs), then run `msllm ARGS`."""
import faulthandler
import os
import signal
import sys
from pathlib import Path

if __name__ == "__main__":
    pid_dir = os.environ.get("MSLLM_PID_DIR")
    if pid_dir and "RANK_ID" in os.environ:
        Path(pid_dir, f"rank_{os.environ['RANK_ID']}.pid").write_text(str(os.getpid()))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from msllm.cli import main

    sys.exit(main(sys.argv[1:]))
