"""`celeris` with one injected engine fault, for tests/integration/test_reliability.py.

`python -m tests.integration.fault_server serve ...` runs the real server, except that the
batched step raises once, on step number $CELERIS_FAULT_STEP (1-based; step 1 is the warm-up),
the way a CUDA out-of-memory or a sampler bug would. With $CELERIS_FAULT_HTTP set, an HTTP
generation request whose prompt contains that value also hits a bug (a TypeError) after its body
is parsed, as an unforeseen HTTP-side bug would: its token and prompt are in the failing frames.
"""

from __future__ import annotations

import os
import sys

from celeris.engine.families.canvas.runner import Runner
from celeris.server.cli import main

FAIL_AT = int(os.environ.get("CELERIS_FAULT_STEP", "2"))
# "fatal": the fault is a BaseException the step worker does not survive (as a C extension's
# abort or a stray SystemExit would), so the server can no longer serve.
FATAL = os.environ.get("CELERIS_FAULT_KIND") == "fatal"


class FatalFault(BaseException):
    pass
_step = Runner.step
_calls = 0


def faulty_step(self, *args, **kwargs):
    global _calls
    _calls += 1
    if _calls == FAIL_AT:
        raise (FatalFault if FATAL else RuntimeError)(f"injected fault in step {_calls}")
    return _step(self, *args, **kwargs)


Runner.step = faulty_step

if os.environ.get("CELERIS_FAULT_HTTP"):
    from celeris.server.http import openai_api

    _engine_requests = openai_api.engine_requests

    def faulty_engine_requests(req, request_id):
        if any(os.environ["CELERIS_FAULT_HTTP"] in str(p) for p in req.prompts):
            raise TypeError("injected HTTP fault")
        return _engine_requests(req, request_id)

    openai_api.engine_requests = faulty_engine_requests

if __name__ == "__main__":
    sys.exit(main())
