"""engine/loop/fair_share.py through the real StepLoop: one owner's n=16 call no longer holds every
running slot while another owner waits (issue 40, item 11), and no sample's tokens depend on
whether it was preempted or how long it waited."""

from __future__ import annotations

import collections
import types
from typing import Optional

import pytest

from celeris.engine.loop import fair_share
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.loop.sim_runner import SimulatedRunner, ordinary_tokens
from celeris.engine.loop.step_loop import StepLoop
from tests.helpers import simulated_llm

LONG = dict(gen_length=64, steps=64, block_length=8)  # A's samples: 64 steps each
SHORT = dict(gen_length=8, steps=8, block_length=8)  # B's request: 8 steps alone


@pytest.fixture(scope="module")
def sim_llm(tiny_model_dir):
    return simulated_llm(tiny_model_dir, 0.0, max_batch=16)


def _seqs(llm, owner: str, n: int, tag: str, **params):
    seqs = []
    for k in range(n):
        seq = llm.request("It is a truth", SamplingParams(seed=k + 1, temperature=0.7, **params), request_id=f"{tag}{k}")
        seq.owner = owner
        seqs.append(seq)
    return seqs


def _run(loop: StepLoop, first: list, later: list, after_steps: int = 2, limit: int = 10_000) -> dict:
    """Step `loop` over `first`, add `later` after `after_steps` steps, run all to the end:
    {request id: (step added, step finished, tokens, preempted at least once)}."""
    added, done, preempted = {}, {}, set()
    for s in first:
        loop.add(s, bounded=False)
        added[s.request_id] = 0
    every = first + later
    while not all(s.finished for s in every):
        if loop.steps == after_steps:
            for s in later:
                if s.request_id not in added:
                    loop.add(s, bounded=False)
                    added[s.request_id] = loop.steps
        loop.step()
        for s in every:
            if s.finished and s.request_id not in done:
                done[s.request_id] = loop.steps
            elif s.nfe and s.slot < 0:  # out of the batch between steps
                preempted.add(s.request_id)
        assert loop.steps < limit
    return {s.request_id: (added[s.request_id], done[s.request_id], list(s.canvas), s.request_id in preempted)
            for s in every}


def test_plan_admits_the_owner_holding_fewest_and_preempts_the_one_above_its_share(sim_llm):
    a = _seqs(sim_llm, "a", 16, "a", **LONG)
    b = _seqs(sim_llm, "b", 3, "b", **SHORT)
    for s in a[:10]:
        s.nfe = 5  # the first ten have taken steps; the last six, none
    victims, admits = fair_share.plan(a, b, free=0, slots=16, resumable=lambda s: True)
    assert victims == [a[15], a[14], a[13]]  # least advanced, last admitted first
    assert admits == b
    # A runner that cannot resume never preempts: B waits for a free slot, then goes first.
    assert fair_share.plan(a, b, free=0, slots=16, resumable=None) == ([], [])
    assert fair_share.plan(a[:15], b + a[15:], free=1, slots=16, resumable=None) == ([], [b[0]])
    # One owner alone is first come, first served, whatever it holds.
    assert fair_share.plan(a[:8], a[8:], free=4, slots=16, resumable=lambda s: True) == ([], a[8:12])
    assert fair_share.share(16, 3) == 5 and fair_share.share(2, 5) == 1


def test_a_second_owner_is_admitted_at_once_beside_sixteen_samples(sim_llm):
    loop = StepLoop(sim_llm.runner, 64)
    a, b = _seqs(sim_llm, "a", 16, "a", **LONG), _seqs(sim_llm, "b", 1, "b", **SHORT)
    out = _run(loop, a, b)
    added, finished, _, _ = out["b0"]
    # B takes one of A's slots at the next step and runs its 8 steps: not A's 64.
    assert finished - added <= SHORT["steps"] + 1, out["b0"][:2]
    assert loop.preemptions == 1
    for k in range(16):  # A's preempted sample finished later, with the same tokens as the rest
        assert out[f"a{k}"][2] == out["a0"][2]


def test_many_owners_each_reach_their_share(sim_llm):
    loop = StepLoop(sim_llm.runner, 64)
    a = _seqs(sim_llm, "a", 16, "a", **LONG)
    b, c = _seqs(sim_llm, "b", 8, "b", **SHORT), _seqs(sim_llm, "c", 8, "c", **SHORT)
    for s in a:
        loop.add(s, bounded=False)
    loop.step()
    for s in b + c:
        loop.add(s, bounded=False)
    loop.step()
    held = collections.Counter(s.owner for s in loop.running)
    assert held == {"a": 6, "b": 5, "c": 5}  # share: 16 // 3 owners = 5; A keeps the remainder
    loop.run_to_completion()
    assert all(s.finished for s in a + b + c)


class FifoRunner(SimulatedRunner):
    """A runner that cannot resume a sample (like the block and revise runners)."""

    resumable = None


def test_without_resumption_further_samples_wait_and_the_other_owner_goes_first(sim_llm):
    runner = FifoRunner(16, 0.0, ordinary_tokens(sim_llm.tokenizer))
    loop = StepLoop(runner, 64)
    a, b = _seqs(sim_llm, "a", 32, "a", **LONG), _seqs(sim_llm, "b", 1, "b", **SHORT)
    out = _run(loop, a, b)
    assert loop.preemptions == 0
    # A's first 16 finish at step 64; B, queued behind A's other 16, is admitted first.
    assert out["b0"][1] <= 64 + SHORT["steps"]
    assert min(out[f"a{k}"][1] for k in range(16, 32)) > 64


def _solo(llm, seq) -> list[int]:
    alone = llm.sequence(list(seq.prompt), seq.params, seq.request_id)
    return _run(StepLoop(llm.runner, 4), [alone], [])[seq.request_id][2]


@pytest.mark.parametrize("kv_cache", [None, "dual"])
def test_preempted_samples_of_the_real_model_decode_as_they_do_alone(tiny_llm, kv_cache: Optional[str]):
    """celeris-tiny: A's 16 samples (random draws) beside B's short call. Preempted ones resume in
    another slot, at any step without a cache, at a block boundary with one (after 4 steps);
    they and B's decode as they do alone, and A's others as A's call does without B."""
    extra = {"kv_cache": kv_cache} if kv_cache else {}
    a = _seqs(tiny_llm, "a", 16, "a", gen_length=32, steps=16, block_length=8, **extra)
    b = _seqs(tiny_llm, "b", 2, "b", **SHORT, **extra)
    out = _run(StepLoop(tiny_llm.runner, 64), a, b, after_steps=1)
    preempted = sorted(k for k, v in out.items() if v[3])
    assert len(preempted) == 2 and all(k.startswith("a") for k in preempted), preempted
    assert max(out[f"b{k}"][1] - out[f"b{k}"][0] for k in range(2)) <= SHORT["steps"] + 4  # not A's 16 steps
    for seq in b + [s for s in a if s.request_id in preempted]:
        assert out[seq.request_id][2] == _solo(tiny_llm, seq), seq.request_id
    again = [tiny_llm.sequence(list(s.prompt), s.params, s.request_id) for s in a]
    without_b = _run(StepLoop(tiny_llm.runner, 64), again, [])
    assert all(out[s.request_id][2] == without_b[s.request_id][2] for s in a)


def _row(owner: str, ticket: int, work: int, skipped: int = 0):
    return types.SimpleNamespace(owner=owner, ticket=ticket, work=work, skipped=skipped)


def test_constraint_budget_keeps_each_owner_to_its_share_longest_waiting_first():
    a = [_row("a", t, 3, skipped=t % 2) for t in range(1, 9)]  # 8 structured rows of 3 units
    b = [_row("b", 20, 0), _row("b", 21, 3)]
    rows = a + b
    kept = fair_share.within_constraint_budget(rows, lambda s: s.work, 16, owners=2)
    assert [s.ticket for s in kept if s.owner == "a"] == [1, 3]  # 8 units each: the two that waited
    assert b[0] in kept and b[1] in kept  # b's one structured row fits; a plain row never waits
    assert [s.ticket for s in kept] == sorted(s.ticket for s in kept)  # the batch's order kept
    one = fair_share.within_constraint_budget(a, lambda s: s.work, 2, owners=2)
    assert len(one) == 1  # a share below one row's work still steps one row
    assert fair_share.within_constraint_budget(a, lambda s: s.work, 16, owners=1) == a  # alone: unlimited
    assert fair_share.within_constraint_budget(rows, lambda s: s.work, None, owners=2) == rows
