"""Run under msrun by tests/conftest.py's msrun_workers: the named worker modules' main(out, rank, world)
one after the other in this worker's one process, so that they share one msrun start-up, cluster join and
teardown (~20 s a launch before any compile).

    msrun ... tests/workers.py OUT_DIR dp_worker cp_worker ep_worker train_worker   # each works in OUT_DIR/<name>/
"""
import importlib
import sys
from pathlib import Path

if __name__ == "__main__":
    from msllm import device
    from msllm.parallel import dp

    device.setup("cpu", "graph", threads=1)
    rank, world = dp.init_process_group()
    out = Path(sys.argv[1])
    for name in sys.argv[2:]:
        importlib.import_module(f"tests.{name}").main(out / name, rank, world)
