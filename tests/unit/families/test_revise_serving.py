"""DiffusionGemma served through LLM and the step loop (issue #30): a request decodes what the
library-level loop (engine/revise_sequence.generate) and transformers' generate() decode for its
prompt and seed, alone and batched with other requests that join and finish at other steps.

Tiny random checkpoints written by transformers' own classes, CPU, float32.
"""

from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.errors import InvalidRequest, ModelLoadError  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.families.revise.runner import ReviseRunner, revise_params  # noqa: E402
from celeris.engine.families.revise.slots import generate  # noqa: E402
from celeris.engine.events import FinishReason  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import (  # noqa: E402
    reference_generate, reference_model, write_checkpoint, write_tokenizer)
from tests.unit.gemma_helpers import PARAMS, PROMPTS, gen_kwargs  # noqa: E402

EOS = 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tokenizer(write_checkpoint(tmp_path_factory.mktemp("dg-serve"), canvas_length=8, seed=8))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM.load(folder, EngineConfig(max_batch=2, max_queue=8, max_prompt_tokens=32, max_gen_length=64))


def _params(llm, pname: str, seed: int, gen_length: int):
    p = PARAMS[pname]
    return replace(llm.defaults, gen_length=gen_length, block_length=gen_length, steps=1, seed=seed,
                   **{k: getattr(p, k) for k in ("max_denoising_steps", "entropy_bound", "t_min", "t_max",
                                                 "stability_threshold", "confidence_threshold")})


def _until_eos(ids):
    return ids[:ids.index(EOS)] if EOS in ids else ids


def test_loads_as_a_revising_family(llm):
    assert llm.family.revising and isinstance(llm.runner, ReviseRunner)
    assert llm.kv_cache == "exact" and llm.model.cfg.left_out == ("vision_config",)
    d = llm.defaults  # the folder's generation_config.json is all nulls: transformers' defaults
    assert (d.max_denoising_steps, d.entropy_bound, d.t_min, d.t_max) == (48, 0.1, 0.4, 0.8)
    assert d.gen_length == 8  # one canvas


@pytest.mark.slow
@pytest.mark.parametrize("pname", ["steps", "rule"])
def test_served_alone_equals_the_library_and_transformers(llm, folder, pname):
    ref = reference_model(folder)
    for prompt, seed in ((PROMPTS[0], 0), (PROMPTS[1], 3)):
        params = _params(llm, pname, seed, 16)
        res = llm.run([llm.sequence(prompt, params)])[0]
        lib = generate(llm.model, prompt, revise_params(params), seed, 16, (EOS,), 0)
        want = reference_generate(ref, prompt, seed, 16, **gen_kwargs(PARAMS[pname], eos_token_id=EOS))
        assert lib == want
        assert res.token_ids == _until_eos(want), (pname, prompt, seed)
        assert res.finish_reason == (FinishReason.STOP if EOS in want else FinishReason.LENGTH)


@pytest.mark.slow
def test_batched_requests_decode_their_solo_text(llm, folder):
    """Five requests on two slots: later ones join as earlier ones finish, rows at different
    canvases and steps share each forward, and each decodes its solo text, which is
    transformers' text for its prompt and seed."""
    ref = reference_model(folder)
    jobs = [(PROMPTS[0], 0, "steps", 16), (PROMPTS[1], 3, "rule", 10), (PROMPTS[2], 5, "confident", 16),
            (PROMPTS[1], 7, "steps", 5), (PROMPTS[0], 9, "rule", 24)]
    seqs = [llm.sequence(pr, _params(llm, pn, seed, new)) for pr, seed, pn, new in jobs]
    batched = llm.run(seqs)
    for (pr, seed, pn, new), res, seq in zip(jobs, batched, seqs):
        solo = generate(llm.model, pr, revise_params(seq.params), seed, new, (EOS,), 0)
        assert res.token_ids == _until_eos(solo), (pr, seed, pn, new)
        assert solo == reference_generate(ref, pr, seed, new, **gen_kwargs(PARAMS[pn], eos_token_id=EOS))
    assert len({r.steps for r in batched}) > 1


def test_events_say_what_is_final(llm):
    """Every event's `settled` is the committed canvases; a position shown before it may change,
    and committed positions never change afterwards."""
    events = []
    params = _params(llm, "steps", 0, 16)
    llm.run([llm.sequence(PROMPTS[0], replace(params, ignore_eos=True, max_denoising_steps=3))], events.append)
    assert all(ev.revising for ev in events)
    final: dict[int, int] = {}
    revised = 0
    for prev, ev in zip([None] + events, events):
        for i in range(ev.settled):
            assert final.setdefault(i, ev.canvas[i]) == ev.canvas[i]  # final never changes
        if prev is not None:
            revised += sum(1 for i in ev.committed if prev.canvas[i] not in (ev.canvas[i], llm.tokenizer.mask_id))
        assert all(not ev.is_final(i, llm.tokenizer.mask_id) for i in range(ev.settled, len(ev.canvas)))
    assert [ev.settled for ev in events if ev.block_complete] == [8, 16]
    assert revised > 0  # the canvas being denoised did change what it showed


def test_a_stop_string_ends_the_request_at_the_canvas_that_holds_it(llm):
    """Stop strings are looked for in final text only, as each canvas is committed: the output is
    the unstopped run's, cut where the stop string first begins, and no canvas after the one
    holding it is denoised. A stop string that never appears changes nothing."""
    params = replace(_params(llm, "steps", 0, 24), ignore_eos=True, max_denoising_steps=3)  # 3 canvases, 9 steps
    full = llm.run([llm.sequence(PROMPTS[0], params)])[0]
    assert full.finish_reason == FinishReason.LENGTH and full.steps == 9
    ids, canvas = full.token_ids, 8
    for pos in (2, canvas + 3, 2 * canvas + 4):  # one stop string from each canvas
        stop = llm.tokenizer.token_text(ids[pos]).strip()
        res = llm.run([llm.sequence(PROMPTS[0], replace(params, stop=(stop, "never said")))])[0]
        cut = full.text.index(stop)
        assert res.finish_reason == FinishReason.STOP, stop
        assert res.text == full.text[:cut]
        assert res.token_ids == ids[:len(res.token_ids)]
        held_by = next(k for k in range(len(ids)) if stop in llm.tokenizer.decode(ids[:k + 1]))
        assert res.steps == 3 * (held_by // canvas + 1), (stop, held_by)  # canvases run: up to the one holding it
    unchanged = llm.run([llm.sequence(PROMPTS[0], replace(params, stop=("never said",)))])[0]
    assert (unchanged.token_ids, unchanged.finish_reason) == (ids, FinishReason.LENGTH)
    assert llm.runner.rows == {}  # a request ended by a stop string left no cache behind


def test_min_tokens_keeps_end_of_sequence_out_of_the_first_positions(llm):
    """A request that ends early with EOS, asked again with min_tokens past that EOS: no stop id in
    its first min_tokens positions, so it is at least that long; logprobs stay the model's own."""
    early = None
    for prompt in PROMPTS:
        for seed in range(8):
            params = replace(_params(llm, "steps", seed, 24), max_denoising_steps=3)
            res = llm.run([llm.sequence(prompt, params)])[0]
            if res.finish_reason == FinishReason.STOP and len(res.token_ids) < 16:
                early = (prompt, params, len(res.token_ids))
                break
        if early:
            break
    assert early, "no request of the tiny checkpoint ended early with EOS"
    prompt, params, n = early
    res = llm.run([llm.sequence(prompt, replace(params, min_tokens=n + 4, logprobs=0))])[0]
    assert len(res.token_ids) >= n + 4 and EOS not in res.token_ids[:n + 4]
    assert all(lp > float("-inf") for lp, _ in res.logprobs)


def test_a_cancelled_request_leaves_no_cache_behind(llm):
    from celeris.engine.loop.step_loop import StepLoop

    loop = StepLoop(llm.runner, max_queue=4)
    seq = llm.sequence(PROMPTS[0], replace(_params(llm, "steps", 0, 24), ignore_eos=True))
    loop.add(seq)
    loop.step()
    assert set(llm.runner.rows) == {seq.slot}
    loop.cancel(seq)
    assert llm.runner.rows == {}


def test_logprobs_are_each_token_under_the_step_that_committed_its_canvas(llm):
    """logprobs: each generated token's log-probability under the model's own logits (no
    temperature) at its canvas's last step, with the top alternatives; asking changes no token."""
    import torch

    from celeris.engine.families.revise.slots import SlotState

    params = replace(_params(llm, "steps", 3, 16), ignore_eos=True, max_denoising_steps=3)
    plain = llm.run([llm.sequence(PROMPTS[1], params)])[0]
    res = llm.run([llm.sequence(PROMPTS[1], replace(params, logprobs=3))])[0]
    assert res.token_ids == plain.token_ids and len(res.logprobs) == 16
    row = SlotState(llm.model, list(PROMPTS[1]), revise_params(params), 3, 16, (), 0)
    want = []
    while not row.finished:  # the library loop, keeping each canvas's last raw logits
        canvas, sc = row.denoise_input()
        logits = llm.model.denoise(canvas, row.cache, sc)[0]
        before = len(row.final)
        row.advance(logits)
        block = row.final[before:]
        want += torch.log_softmax(logits.float(), -1)[torch.arange(len(block)), block].tolist()
    assert row.final == res.token_ids
    for (lp, top), w, tok in zip(res.logprobs, want, res.token_ids):
        assert lp == pytest.approx(w, abs=1e-4)
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][1] >= lp and (tok not in dict(top) or dict(top)[tok] == pytest.approx(lp))


def test_mask_knobs_are_refused_and_revise_knobs_checked(llm):
    with pytest.raises(InvalidRequest) as e:
        llm.sequence(PROMPTS[0], replace(llm.defaults, temperature=0.5, top_k=3))
    assert {v.field for v in e.value.violations} == {"temperature", "top_k"}
    with pytest.raises(InvalidRequest) as e:
        llm.sequence(PROMPTS[0], replace(llm.defaults, t_min=-1.0, max_denoising_steps=0))
    assert {v.field for v in e.value.violations} == {"t_min", "max_denoising_steps"}


def test_cuda_is_accepted_and_an_absent_device_refused_by_name(folder, monkeypatch):
    """CUDA is served (tests/gpu/test_revise_cuda.py runs it); asking for it where torch sees none
    is a load error that says so, before any weight is read."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        LLM.load(folder, EngineConfig(device="cuda"))


def test_mask_families_refuse_the_revise_knobs():
    from celeris.engine.families.registry import family_of
    from celeris.engine.sampling.params import SamplingParams
    from tests.helpers import tiny_config

    bad = family_of(tiny_config()).violations(replace(SamplingParams(), t_max=0.9, entropy_bound=0.2))
    assert {v.field for v in bad} == {"t_max", "entropy_bound"}
