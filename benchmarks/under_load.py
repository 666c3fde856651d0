"""Run a command while two busy processes load the machine on and off at random (a benchmark helper).

    python benchmarks/under_load.py -- python -m skipsearch optimize --seed 1 --study-name loaded-1

The load is the same as `objective_noise.py --load`: each process burns one core for a random
0.5-3 s, then rests for a random 0.5-3 s, until the command ends. Exits with the command's code.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time

from objective_noise import busy_on_and_off


def main() -> int:
    command = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else sys.argv[1:]
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    workers = [multiprocessing.Process(target=busy_on_and_off, args=(seed, time.time() + 24 * 3600), daemon=True)
               for seed in (11, 12)]
    for worker in workers:
        worker.start()
    try:
        return subprocess.call(command)
    finally:
        for worker in workers:
            worker.terminate()


if __name__ == "__main__":
    sys.exit(main())
