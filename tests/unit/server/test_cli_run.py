"""`celeris run`: one in-process generation, JSON output, one-line errors naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from celeris.server.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celeris.server.cli", *args], capture_output=True, text=True, timeout=120)


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


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
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


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
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


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_run_timings_split_on_the_embedded_model():
    """The start-up split is printed and recorded; loading the embedded model no longer pulls in
    torch._dynamo (the meta-device init did, about 1 s), and stays a small part of the start-up."""
    r = run_cli("run", "--prompt", "It is a truth", "--gen-length", "4", "--json", "--timings")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["timings"]
    assert set(t) == {"imports_s", "load_s", "generate_s", "threads"} and t["threads"] >= 1
    assert all(t[k] >= 0 for k in ("imports_s", "load_s", "generate_s"))
    assert "start-up" in r.stderr and "model build and load" in r.stderr
    probe = ("import sys; from celeris.engine.llm import LLM; LLM.load(); "
             "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_skip_meta_init_only_skips_meta_tensors():
    import torch

    from celeris.engine.models.weights import skip_meta_init

    before = torch.nn.init.normal_
    with skip_meta_init():
        with torch.device("meta"):
            meta = torch.nn.Linear(4, 4)
        real = torch.nn.init.normal_(torch.zeros(64), std=1.0)
    assert torch.nn.init.normal_ is before  # restored
    assert meta.weight.is_meta and real.abs().sum() > 0  # real tensors still initialized
