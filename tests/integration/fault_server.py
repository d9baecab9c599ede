"""`celeris` with one injected engine fault, for tests/integration/test_reliability.py.

`python -m tests.integration.fault_server serve ...` runs the real server, except that the
batched step raises once, on step number $CELERIS_FAULT_STEP (1-based; step 1 is the warm-up),
the way a CUDA out-of-memory or a sampler bug would.
"""

from __future__ import annotations

import os
import sys

from engine.runner import Runner
from server.cli import main

FAIL_AT = int(os.environ.get("CELERIS_FAULT_STEP", "2"))
_step = Runner.step
_calls = 0


def faulty_step(self, *args, **kwargs):
    global _calls
    _calls += 1
    if _calls == FAIL_AT:
        raise RuntimeError(f"injected fault in step {_calls}")
    return _step(self, *args, **kwargs)


Runner.step = faulty_step

if __name__ == "__main__":
    sys.exit(main())
