"""`celeris run`: one in-process generation, JSON output, one-line errors naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=120)


def test_run_json_output(tiny_model_dir, capsys):
    rc = main(["run", "--model", str(tiny_model_dir), "--prompt", "It is a truth", "--gen-length", "16",
               "--steps", "8", "--block-length", "8", "--seed", "3", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"text", "token_ids", "steps", "finish_reason"}
    assert out["steps"] <= 8 and len(out["token_ids"]) <= 16 and out["finish_reason"] in ("length", "stop")
    assert 2 not in out["token_ids"]  # EOS trimmed


def test_run_threshold_uses_fewer_forwards(tiny_model_dir, capsys):
    main(["run", "--model", str(tiny_model_dir), "--prompt", "It is a truth", "--gen-length", "32", "--steps", "32",
          "--block-length", "8", "--threshold", "0.01", "--json"])
    assert json.loads(capsys.readouterr().out)["steps"] < 32


@pytest.mark.parametrize("args,flag", [
    (["--gen-length", "12", "--block-length", "8"], "--block-length"),
    (["--gen-length", "16", "--block-length", "4", "--steps", "6"], "--steps"),
    (["--temperature", "-1"], "--temperature"),
    (["--remasking", "sideways"], "--remasking"),
    (["--threshold", "1.5"], "--threshold"),
])
def test_bad_values_exit_nonzero_with_one_line_naming_the_flag(tiny_model_dir, args, flag):
    p = run_cli("run", "--model", str(tiny_model_dir), "--prompt", "hi", *args)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], p.stderr


def test_missing_model_folder(tmp_path):
    p = run_cli("run", "--model", str(tmp_path / "absent"), "--prompt", "hi")
    assert p.returncode != 0
    assert "--model" in p.stderr and "does not exist" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_generation_config_sets_model_defaults(tiny_model_dir, tmp_path, capsys):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"gen_length": 8, "steps": 4, "block_length": 8}))
    main(["run", "--model", str(d), "--prompt", "It is", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] <= 4 and len(out["token_ids"]) <= 8
