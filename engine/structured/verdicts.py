"""Grammar verdicts computed in a child process, each within a deadline.

Checking a JSON schema (a tool's parameters) means compiling it with llguidance, and some schemas
take seconds each (an `allOf` of `anyOf`s of objects: ~0.5 s a tool on a 2-core VM, 40 such tools
a request). In the server's process that compile holds the GIL for up to ~0.1 s at a time (it
stalled the event loop and every other client's step), and nothing inside llguidance bounds its
time. So the verdict (the library's refusal, or "") is computed in a child process that imports
llguidance only: the server's threads never wait on its GIL, and a compile past its deadline is
ended by killing the child (a fresh one starts for the next verdict), the schema refused by name.

One child per `Verdicts`, one verdict at a time (callers are the structured-output lanes, which
run one build at a time each); verdicts are remembered (GRAMMAR_CACHE of them).
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import Optional

from celeris.engine.structured.spec import GRAMMAR_CACHE

# The child: reads one JSON string a line (a lark grammar's text), answers one JSON string a line
# (the library's first line of refusal, or ""), with the engine's own work limits (spec.LIMITS),
# at a lower CPU priority than the server (nice 10).
_CHILD = """
import json, os, sys
os.nice(10)  # below the server's threads: on a busy host a compile takes the CPU the steps leave
import llguidance
limits = llguidance.LLParserLimits(max_lexer_states=50_000, step_lexer_fuel=2_000_000)
for line in sys.stdin:
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(json.loads(line))
        msg = llguidance.LLMatcher.validate_grammar(grammar, None, limits=limits)
    except Exception as e:
        msg = str(e)
    sys.stdout.write(json.dumps(msg.strip().split("\\n")[0][:200]) + "\\n")
    sys.stdout.flush()
"""


class VerdictTimeout(Exception):
    """A grammar did not compile within its deadline (the child was ended)."""


class Verdicts:
    """llguidance's verdict on lark grammars, from a child process, `deadline_s` each at most."""

    def __init__(self):
        self._child: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self._known: OrderedDict[str, str] = OrderedDict()

    def problem(self, grammar: str, deadline_s: float) -> str:
        """The library's refusal of `grammar` ("" if it compiles); VerdictTimeout past the deadline."""
        with self._lock:
            hit = self._known.get(grammar)
            if hit is not None:
                return hit
            msg = self._ask(grammar, deadline_s)
            self._known[grammar] = msg
            if len(self._known) > GRAMMAR_CACHE:
                self._known.popitem(last=False)
            return msg

    def _ask(self, grammar: str, deadline_s: float) -> str:
        child = self._child
        if child is None or child.poll() is not None:
            child = self._child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            child.stdin.write(json.dumps(grammar) + "\n")
            child.stdin.flush()
            ready, _, _ = select.select([child.stdout], [], [], max(deadline_s, 0.0))
            line = child.stdout.readline() if ready else ""
        except (OSError, ValueError):
            line = ""
        if not line:  # past the deadline, or the child died (its memory, a crash): a fresh one next time
            self.close()
            raise VerdictTimeout
        return json.loads(line)

    def close(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()
            for pipe in (child.stdin, child.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass


__all__ = ["Verdicts", "VerdictTimeout"]
