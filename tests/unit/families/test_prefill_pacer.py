"""The chunked prefill's pacer (engine/families/block/chunked_prefill.py, issue 60 item 6), on
simulated step times (no clock): a step costs a fixed decode time plus, per prompt token, a cost
that grows with the keys it attends over, as attention does. Paced, every step of a 4,000-token
prompt's prefill stays within 2x the decode-only step; a fixed cap of the block rows' tokens
(what the runner did before) does not, once the prompt is long."""

from __future__ import annotations

import types

from celeris.engine.families.block.chunked_prefill import FLOOR, PrefillPacer, cap_prefill_chunks
from celeris.engine.families.block.sequence import PREFILL

DECODE_S = 0.010  # 8 rows of a 4-token block
BLOCK = 4


def step_seconds(chunk: int, context: int) -> float:
    """A step beside the block rows: each prompt token costs 20 us plus 0.1 us a key before it."""
    return DECODE_S + sum(20e-6 + 0.1e-6 * (context + k) for k in range(chunk))


def prefill(pacer: PrefillPacer, paced: bool, prompt: int = 4000, decode_tokens: int = 32) -> list[float]:
    """Steps of a `prompt`-token prefill beside the block rows, each observed by `pacer`, chunks
    from it when `paced` (else the block rows' tokens), in whole blocks: their simulated seconds."""
    done, out = 0, []
    while done < prompt:
        budget = cap(pacer.chunk() if paced else None, decode_tokens)
        chunk = min(prompt - done, max(BLOCK, budget // BLOCK * BLOCK))
        out.append(step_seconds(chunk, done))
        pacer.observe(out[-1], chunk, True)
        done += chunk
    return out


def cap(paced, decode_tokens: int) -> int:
    return decode_tokens if paced is None else max(paced, decode_tokens // FLOOR)


def test_paced_chunks_keep_every_step_within_twice_a_decode_step():
    pacer = PrefillPacer()
    for _ in range(5):
        pacer.observe(DECODE_S, 0, True)
    steps = prefill(pacer, paced=True)
    assert max(steps) <= 2 * DECODE_S, max(steps) / DECODE_S
    assert len(steps) < 4000 // BLOCK / 2  # chunks of several blocks where tokens are cheap
    fixed = prefill(PrefillPacer(), paced=False)  # 32 tokens a step whatever they cost
    assert max(fixed) > 2 * DECODE_S


def test_pacer_follows_the_cost_and_knows_nothing_before_it_has_seen_both():
    pacer = PrefillPacer(target=1.5, smoothing=1.0)  # the newest observation only
    assert pacer.chunk() is None
    pacer.observe(0.010, 64, True)  # no decode-only step seen: nothing to subtract yet
    assert pacer.chunk() is None
    pacer.observe(0.010, 0, True)
    pacer.observe(0.020, 100, True)  # 100 us a prompt token beside the block rows
    assert pacer.chunk() == 50  # (1.5 - 1) x 10 ms / 100 us
    pacer.observe(0.030, 100, True)  # dearer tokens (a longer prefix): smaller chunks
    assert pacer.chunk() == 25
    pacer.observe(0.050, 100, False)  # alone, a whole step's time counts against its tokens
    assert pacer.chunk() == 10


def test_cap_prefill_chunks_shares_the_paced_chunk_with_a_floor():
    def row(phase, window=(0, 4)):
        return types.SimpleNamespace(phase=phase, window=window, step_chunk=-1)
    decode = [row("denoise") for _ in range(8)]  # 32 block tokens
    two = [row(PREFILL), row(PREFILL)]
    cap_prefill_chunks(decode + two, True, paced=200)
    assert [s.step_chunk for s in two] == [100, 100]
    cap_prefill_chunks(decode + two, True, paced=0)  # noise made tokens look dear: the floor
    assert [s.step_chunk for s in two] == [32 // FLOOR // 2] * 2
    cap_prefill_chunks(decode + two, True, paced=None)  # not measured yet: the block rows' tokens
    assert [s.step_chunk for s in two] == [16, 16]
    alone = [row(PREFILL)]
    cap_prefill_chunks(alone, True, paced=5)
    assert alone[0].step_chunk == 0  # nothing denoising: whole prefill_chunk chunks
