"""The script msrun starts on every worker (msrun runs `python SCRIPT ARGS`): note this process's
pid by rank, so `msllm launch` can name a worker that dies, let SIGUSR1 dump its Python stacks
into its log (the launch watchdog asks when it hangs), then run `msllm ARGS`. msrun runs this script as its
scheduler too, with RANK_ID 0 (mindspore/parallel/cluster/process_entity/_api.py): only workers write a pid
file, else the scheduler and rank 0 race for rank_0.pid and launch may stop or name the scheduler."""
import faulthandler
import os
import signal
import sys
from pathlib import Path

if __name__ == "__main__":
    pid_dir = os.environ.get("MSLLM_PID_DIR")
    if pid_dir and "RANK_ID" in os.environ and os.environ.get("MS_ROLE") != "MS_SCHED":
        Path(pid_dir, f"rank_{os.environ['RANK_ID']}.pid").write_text(str(os.getpid()))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from msllm.cli import main

    sys.exit(main(sys.argv[1:]))
