"""No head-of-line padding: the grouping of running requests and the choice of which group steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from celeris.engine.loop.batching import Group, Picker, partition
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM


def test_partition_keeps_like_lengths_together_and_splits_far_ones():
    rows = [24, 30, 1024, 28, 1000]
    groups = partition(rows, lambda r: r, overhead=256)
    assert [g.rows for g in groups] == [[24, 28, 30], [1000, 1024]]
    assert [g.tokens for g in groups] == [30, 1024]


def test_partition_is_one_forward_when_padding_costs_less_than_another_forward():
    assert len(partition([40, 80, 64], lambda r: r, overhead=256)) == 1
    assert [g.rows for g in partition([40, 80, 64], lambda r: r, overhead=256)] == [[40, 64, 80]]
    # The same rows with a cheap forward: separate groups win.
    assert len(partition([40, 80], lambda r: r, overhead=1)) == 2


def test_partition_shortcut_to_one_group_agrees_with_the_search_at_its_edge():
    """One group when its padding (2 x 80 - 120 = 40 tokens) is at most one forward's overhead:
    at 40 the split costs as much (80 + 40 + 80 = 40 + 160) and the search keeps one group; at 39
    the split is cheaper."""
    assert [g.rows for g in partition([80, 40], lambda r: r, overhead=40)] == [[40, 80]]
    assert [g.rows for g in partition([80, 40], lambda r: r, overhead=39)] == [[40], [80]]


def test_partition_is_the_cheapest_contiguous_grouping():
    import itertools

    rows = [5, 9, 40, 41, 300, 310, 900]
    best = min(
        sum(256 + len(g) * max(g) for g in _split(rows, cuts))
        for k in range(len(rows)) for cuts in itertools.combinations(range(1, len(rows)), k))
    assert sum(g.cost(256) for g in partition(rows, lambda r: r, 256)) == best


def test_partition_matches_every_cut_search_with_repeated_sizes():
    """Cuts are tried only where sizes change; the cost is that of the search over every cut."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        rows = sorted(rng.choice([8, 8, 16, 40, 41, 300]) for _ in range(rng.randint(1, 9)))
        overhead = rng.choice([0, 1, 24, 256])
        best = min(
            sum(overhead + len(g) * max(g) for g in _split(rows, cuts))
            for k in range(len(rows)) for cuts in itertools.combinations(range(1, len(rows)), k))
        groups = partition(rows, lambda r: r, overhead)
        assert sum(g.cost(overhead) for g in groups) == best
        assert sorted(r for g in groups for r in g.rows) == rows


def test_partition_of_one_size_is_one_group():
    assert [g.rows for g in partition([64] * 32, lambda r: r, 0)] == [[64] * 32]
    assert partition([], lambda r: r, 256) == []


def _split(rows, cuts):
    bounds = [0, *cuts, len(rows)]
    return [rows[a:b] for a, b in zip(bounds, bounds[1:])]


class Row:
    def __init__(self, remaining: float = 0.0, skipped: int = 0):
        self.remaining, self.skipped = remaining, skipped


def test_picker_prefers_the_group_with_least_work_left_and_bounds_starvation():
    pick = Picker(lambda r: r.remaining, lambda r: r.skipped, max_skips=4).pick
    old, new = Group([Row(remaining=64 * 1024)], 1024), Group([Row(remaining=16 * 24)], 24)
    assert pick([old, new]) is new
    old.rows[0].skipped = 4
    assert pick([old, new]) is old


@pytest.fixture
def llm(tiny_model_dir):
    # Overhead 64 tokens: a 16-token request and a 200-token one do not share a forward.
    return LLM.load(tiny_model_dir, EngineConfig(max_batch=4, max_prompt_tokens=256, max_gen_length=64,
                                                 forward_overhead_tokens=64))


def _run(llm, seqs):
    """Step until every sequence finishes; return each request's finishing step index and the
    batches run (request ids per step)."""
    for s in seqs:
        llm.loop.add(s, bounded=False)
    batches, done = [], {}
    while not llm.loop.idle:
        events, record = llm.loop.step()
        batches.append(record.request_ids)
        for ev in events:
            if ev.finished:
                done[ev.request_id] = len(batches)
    return done, batches


def test_a_short_request_beside_a_long_one_steps_without_it(llm):
    p = replace(llm.defaults, gen_length=16, steps=16, block_length=8, seed=0)
    long_prompt = list(range(10, 200))
    long = llm.sequence(long_prompt, replace(p, gen_length=64, steps=64), request_id="long")
    short = llm.sequence([1, 40, 41], p, request_id="short")
    done, batches = _run(llm, [long, short])
    # The short request stepped in forwards of its own, ahead of the long one (least work left):
    # it finished after its own 16 steps, at most one of them beside a forced long step.
    assert all(ids == ("short",) or ids == ("long",) for ids in batches)
    assert done["short"] <= 16 + 1
    assert sum(ids == ("long",) for ids in batches) == 64


def test_grouping_changes_no_tokens(llm, tiny_model_dir):
    """Rows are batch-invariant on CPU, so who shares a forward never changes what is generated."""
    p = replace(llm.defaults, gen_length=16, steps=16, block_length=8, seed=0)
    prompts = [[1, 40, 41], list(range(10, 200)), [1, 50, 51, 52]]
    together = LLM.load(tiny_model_dir, EngineConfig(max_batch=4, max_prompt_tokens=256, max_gen_length=64,
                                                     forward_overhead_tokens=10**9))
    a = [llm.result(s).token_ids for s in _finished(llm, prompts, p)]
    b = [together.result(s).token_ids for s in _finished(together, prompts, p)]
    assert a == b


def _finished(llm, prompts, p):
    seqs = [llm.sequence(x, p, request_id=str(i)) for i, x in enumerate(prompts)]
    _run(llm, seqs)
    return seqs


def test_rows_in_different_forwards_of_the_runner_step_together(tiny_model_dir):
    """With a KV cache, a block's first step (a full forward that stores the cache) and the
    cached steps of other rows are separate forwards of one step whatever the grouping: the
    scheduler groups by length within each kind, so neither waits for the other."""
    llm = LLM.load(tiny_model_dir, EngineConfig(max_batch=4, max_prompt_tokens=256, max_gen_length=64,
                                                forward_overhead_tokens=64, kv_cache="dual"))
    p = replace(llm.defaults, gen_length=32, steps=32, block_length=16, seed=0, stop_at_eos=False)
    early = llm.sequence([1, 40, 41], p, request_id="early")
    llm.loop.add(early, bounded=False)
    for _ in range(3):  # early is now in cached steps of its first block
        llm.loop.step()
    late = llm.sequence(list(range(10, 160)), p, request_id="late")  # its first step: a 182-column store
    llm.loop.add(late, bounded=False)
    _, record = llm.loop.step()
    # By length alone these two would not share a forward (182 vs 17 columns, overhead 64).
    assert sorted(record.request_ids) == ["early", "late"] and record.stats.forwards == 2
    while not llm.loop.idle:
        llm.loop.step()
    alone = llm.sequence(list(range(10, 160)), p, request_id="alone")
    llm.loop.add(alone, bounded=False)
    while not llm.loop.idle:
        llm.loop.step()
    assert llm.result(late).token_ids == llm.result(alone).token_ids  # who steps beside changes no token


def test_a_group_over_the_token_budget_steps_its_rows_in_turns(tiny_model_dir):
    """max_forward_tokens: four like rows of ~80 tokens under a 200-token budget step two at a
    time, those that waited longest first (each row every other step); the tokens are those of
    one forward over all four."""
    prompts = [list(range(10 + k, 74 + k)) for k in range(4)]
    config = dict(max_batch=8, max_prompt_tokens=256, max_gen_length=64)
    budgeted = LLM.load(tiny_model_dir, EngineConfig(max_forward_tokens=200, **config))
    whole = LLM.load(tiny_model_dir, EngineConfig(max_forward_tokens=0, **config))
    p = replace(whole.defaults, gen_length=16, steps=16, block_length=8, seed=0)
    assert budgeted.runner.forward_token_budget == 200 and whole.runner.forward_token_budget is None
    seqs = [budgeted.sequence(x, p, request_id=str(i)) for i, x in enumerate(prompts)]
    done, batches = _run(budgeted, seqs)
    assert all(len(ids) == 2 for ids in batches) and len(batches) == 2 * 16
    assert batches[0] != batches[1] and set(batches[0]) | set(batches[1]) == {"0", "1", "2", "3"}
    assert [budgeted.result(s).token_ids for s in seqs] == \
        [whole.result(s).token_ids for s in _finished(whole, prompts, p)]
    assert EngineConfig().forward_token_budget == 2048  # the CPU default
