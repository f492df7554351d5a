"""Calibrate the simulator's ``cpu-demo`` worker profile on a real llama-server (not part of
pytest; run by hand, under the shared benchmark lock on a shared machine):

    flock /tmp/bench.lock python tests/bench/calibrate.py [--out docs/calibration/cpu-demo.json]

The same as ``llama-gateway calibrate`` (see ``gateway/simulator/measure.py`` for what is
measured and ``gateway/simulator/calibration.py`` for the fit); prints the tables, writes the
JSON that ``llama-gateway simulate --profile FILE`` reads.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["calibrate", *sys.argv[1:]]))
