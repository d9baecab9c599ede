"""The `celeris` command (celeris_client.launcher) with the server installed beside the client.

The client-only install is exercised for real in tests/integration/test_packaging.py."""

import argparse

import pytest

from celeris_client import launcher


def subcommands(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_the_launcher_knows_every_server_command():
    from celeris.server.cli import build_parser

    server = set(subcommands(build_parser())) - set(launcher.CLIENT_COMMANDS)
    assert server == set(launcher.SERVER_COMMANDS)


def test_client_only_help_lists_both_kinds_of_command():
    text = launcher.client_only_help()
    for name in (*launcher.CLIENT_COMMANDS, *launcher.SERVER_COMMANDS):
        assert name in text
    assert launcher.SERVER_INSTALL in text


def test_server_commands_go_to_the_server_and_client_commands_stay_here(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr("celeris.server.cli.main", lambda argv: seen.append(argv) or 0)
    assert launcher.main(["serve", "--port", "0"]) == 0 and seen == [["serve", "--port", "0"]]
    with pytest.raises(SystemExit) as e:
        launcher.main(["generate", "--help"])
    assert e.value.code == 0 and "--server" in capsys.readouterr().out and len(seen) == 1


def test_without_the_server_its_commands_say_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "server_cli", lambda: None)
    assert launcher.main(["serve"]) == 2
    assert "needs the server install" in capsys.readouterr().err
    assert launcher.main(["--help"]) == 0 and "need the server install" in capsys.readouterr().out
    assert launcher.main([]) == 2
