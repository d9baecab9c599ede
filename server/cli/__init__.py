"""The `celeris` command's server side (server/cli/entry.py), under the name the launcher looks up:
`celeris.server.cli.main(argv)` and `celeris.server.cli.build_parser()`; `python -m celeris.server.cli`
runs it too (server/cli/__main__.py)."""

from celeris.server.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
