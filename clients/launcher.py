"""The `celeris` command, installed by the client distribution.

Client commands (generate, batch, bench --server) run here and never load torch. The server's
commands (serve, run, train, eval, bench --in-process) live in `celeris.server.cli`, which only
the server distribution installs; the launcher looks it up by name when one of them is asked for,
so a client-only install says what is missing instead of crashing on `import torch`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Optional

CLIENT_COMMANDS = ("generate", "batch", "bench")
# What `celeris.server.cli` adds (tests/unit/clients/test_launcher.py keeps this in step with its parser).
SERVER_COMMANDS = {
    "serve": "run the gRPC server (and optionally the HTTP gateway and web page)",
    "run": "one in-process generation, no server",
    "train": "train celeris-tiny from scratch",
    "eval": "held-out loss and skill accuracy under several decoders",
}
SERVER_INSTALL = "pip install . (from the repository's top: the server, with torch)"


def server_cli() -> Optional[ModuleType]:
    """`celeris.server.cli`, or None where only the client distribution is installed."""
    try:
        return importlib.import_module("celeris.server.cli")
    except ModuleNotFoundError as e:
        if e.name in ("celeris.server", "celeris.server.cli"):
            return None
        raise  # the server is installed but broken (torch missing, say): show the real error


def client_only_help() -> str:
    from celeris_client.cli import build_parser

    ap = build_parser()
    ap.description = "Celeris: serve and call diffusion language models. This is the client-only install."
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    width = max(map(len, SERVER_COMMANDS))
    ap.epilog = (f"server commands (need the server install: {SERVER_INSTALL}):\n"
                 + "\n".join(f"  {name:<{width}}  {text}" for name, text in SERVER_COMMANDS.items()))
    return ap.format_help()


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else None
    in_process = command == "bench" and "--in-process" in argv
    if command in CLIENT_COMMANDS and not in_process:
        from celeris_client.cli import main as client_main

        return client_main(argv)
    server = server_cli()
    if server is not None:
        return server.main(argv)
    if command in (None, "-h", "--help"):
        print(client_only_help(), file=sys.stdout if command else sys.stderr)
        return 0 if command else 2
    if command in SERVER_COMMANDS or in_process:
        what = "bench --in-process" if in_process else command
        print(f"celeris {what}: needs the server install, which this environment lacks: {SERVER_INSTALL}",
              file=sys.stderr)
        return 2
    from celeris_client.cli import main as client_main

    return client_main(argv)  # argparse names the unknown command and lists the choices


if __name__ == "__main__":
    sys.exit(main())
