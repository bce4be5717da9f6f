"""Test-only: a rank that reports what its launcher gave it (run as `-m rank_report`; tests/test_warm_launch.py).

Writes $RANK_REPORT_DIR/rank-<RANK>.json: its pid, session and parent, and its environment. With RANK_REPORT_FAIL
naming this rank it exits 3 at once; the other ranks then sleep until they are stopped.
"""

import json
import os
import sys
import time
from pathlib import Path

rank = os.environ["RANK"]
report = {"pid": os.getpid(), "session": os.getsid(0), "parent": os.getppid(), "argv": sys.argv[1:],
          "environ": dict(os.environ)}
Path(os.environ["RANK_REPORT_DIR"], f"rank-{rank}.json").write_text(json.dumps(report))
if "RANK_REPORT_FAIL" in os.environ:
    if os.environ["RANK_REPORT_FAIL"] == rank:
        sys.exit(3)
    time.sleep(600)
