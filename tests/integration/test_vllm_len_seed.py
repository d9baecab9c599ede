"""vLLM's `--max-model-len` and `--seed` under vLLM's meanings (issue 45): the most prompt +
generated tokens of a request (the prompt and canvas limits, whose sum /v1/models reports), refused
over the model's own limit at start-up; and the seed unseeded requests' seeds are drawn from, so a
restarted server answers the same requests the same way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from celeris.engine.errors import EngineError
from celeris.server.cli.vllm_flags import apply_model_len, apply_to_model
from tests.integration.server_process import ROOT


def _parse(*argv: str):
    from celeris.server.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def _limits(*argv: str) -> tuple[int, int]:
    a = _parse(*argv)
    apply_model_len(a)
    return a.max_prompt_tokens, a.max_gen_length


def test_max_model_len_is_the_prompt_and_canvas_limits_sum():
    assert _limits() == (None, 512)  # not given: the canvas's own limit; the prompt's follows the model folder
    from celeris.engine.llm import default_prompt_tokens
    assert default_prompt_tokens(None, 512) == 512  # celeris-tiny as shipped: 1,024 positions less the canvas
    assert _limits("--max-model-len", "1024") == (512, 512)
    assert _limits("--max-model-len", "300") == (150, 150)  # the canvas at most half
    assert _limits("--max-model-len", "1000", "--max-gen-length", "64") == (936, 64)
    with pytest.raises(EngineError, match="at least 2"):
        _limits("--max-model-len", "1")


def test_max_model_len_is_what_the_server_reports_and_enforces():
    from celeris.engine.errors import InvalidRequest
    from celeris.engine.llm import LLM
    from celeris.engine.sampling.params import SamplingParams
    from celeris.engine.requests import Request
    from celeris.server.cli.args import engine_config_from_args

    a = _parse("--max-model-len", "96")
    apply_model_len(a)
    llm = LLM.load(None, engine_config_from_args(a, max_prompt_tokens=a.max_prompt_tokens,
                                                 max_gen_length=a.max_gen_length))
    apply_to_model(llm, a)  # within celeris-tiny's own 1,024
    assert llm.max_model_len == 96
    def build(prompt: int, gen: int):
        params = SamplingParams(gen_length=gen, steps=gen, block_length=gen)
        return llm.requests.build(Request(token_ids=list(range(5, 5 + prompt)), params=params))

    build(48, 48)
    with pytest.raises(InvalidRequest, match="prompt"):
        build(49, 8)
    with pytest.raises(InvalidRequest, match="gen_length"):
        build(2, 64)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_max_model_len_over_the_models_own_limit_is_a_start_up_error():
    from celeris.engine.llm import LLM

    with pytest.raises(EngineError, match="own limit of 1024 tokens"):
        apply_to_model(LLM.load(), _parse("--max-model-len", "4096"))
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    env.pop("CELERIS_API_TOKEN", None)
    out = subprocess.run([sys.executable, "-m", "celeris.server.cli", "serve", "--no-http", "--grpc-port", "0",
                          "--threads", "1", "--max-model-len", "4096"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "--max-model-len 4096 is more than" in out.stderr and "own limit of 1024 tokens" in out.stderr


def _unseeded_texts(llm, n: int = 3) -> list[tuple[int, str]]:
    from celeris.engine.sampling.params import SamplingParams

    params = SamplingParams(gen_length=16, steps=8, block_length=8, temperature=1.0)
    prompt = llm.encode_prompt("It is a truth universally")
    return [(r.seed, r.text) for r in (llm.generate([prompt], params)[0] for _ in range(n))]


def test_seed_makes_unseeded_requests_reproducible_across_restarts():
    from celeris.engine.llm import LLM

    llm = LLM.load()
    apply_to_model(llm, _parse("--seed", "1234"))
    first = _unseeded_texts(llm)
    apply_to_model(llm, _parse("--seed", "1234"))  # a restarted server, same flag
    assert _unseeded_texts(llm) == first
    assert len({seed for seed, _ in first}) == 3  # each request still draws its own
    apply_to_model(llm, _parse("--seed", "1235"))
    assert [s for s, _ in _unseeded_texts(llm)] != [s for s, _ in first]
    apply_to_model(llm, _parse())  # no --seed: the OS's seeds, as before
    assert [s for s, _ in _unseeded_texts(llm)] != [s for s, _ in first]
