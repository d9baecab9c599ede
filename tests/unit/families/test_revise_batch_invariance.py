"""DiffusionGemma decodes the same tokens alone and in any batch (issue #40 item 12).

The checkpoint is chosen to amplify rounding: top-3 routing over 8 experts (an expert's matmul
would run over whichever rows of the batch chose it) and a self-conditioning GLU scaled 8x, so a
last-bit difference in one step's logits grows over the canvas's steps into different tokens.
Before the rows ran their own forwards, 23 of these 55 requests decoded differently batched than
alone. Tiny random checkpoint written by transformers' classes; CPU, float32.
"""

import random

import pytest
import torch

pytest.importorskip("transformers")

from celeris.engine.families.revise.model import KVCache  # noqa: E402
from celeris.engine.families.revise.weights import load_gemma  # noqa: E402
from celeris.engine.families.revise.sampler import ReviseParams  # noqa: E402
from celeris.engine.families.revise.slots import SlotState, generate, step_rows  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import write_checkpoint  # noqa: E402

BATCHES = (2, 3, 5, 8, 13, 24)  # 55 requests, each decoded alone and in one of these batches
SETTINGS = (ReviseParams(max_denoising_steps=12),
            ReviseParams(max_denoising_steps=10, entropy_bound=1.5, t_min=0.05, t_max=0.3, stability_threshold=1,
                         confidence_threshold=2.5))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("dg-amplify"), canvas_length=8, seed=11, sc_gain=8.0,
                              num_experts=8, top_k_experts=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: one thread is fastest, and these machines are shared
    yield load_gemma(folder)
    torch.set_num_threads(threads)


def _jobs(n: int) -> list[tuple[list[int], int, ReviseParams, int]]:
    """Mixed requests: prompts of 2-10 tokens (so rows read keys of different lengths), seeds,
    both sampler settings, one or two canvases."""
    rng = random.Random(0)
    return [([2] + [rng.randrange(3, 96) for _ in range(rng.randrange(1, 10))], rng.randrange(1000),
             rng.choice(SETTINGS), rng.choice((8, 16))) for _ in range(n)]


def _batched(model, jobs) -> list[list[int]]:
    """Every request of the batch shares each step until it finishes (at different steps)."""
    seqs = [SlotState(model, prompt, p, seed, new, (), 0) for prompt, seed, p, new in jobs]
    while not all(s.finished for s in seqs):
        step_rows(model, seqs)
    return [s.final for s in seqs]


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_requests_decode_alone_and_in_batches_of_2_to_24_alike(model):
    jobs = _jobs(sum(BATCHES))
    alone = [generate(model, prompt, p, seed, new, (), 0) for prompt, seed, p, new in jobs]
    together, start = [], 0
    for size in BATCHES:
        together += _batched(model, jobs[start:start + size])
        start += size
    differ = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
    assert not differ, f"{len(differ)} of {len(jobs)} requests decoded differently batched: {differ}"


def test_a_rows_logits_are_bitwise_its_logits_alone(model):
    """One forward, rows with different key lengths, with and without self-conditioning logits."""
    g, rng = torch.Generator().manual_seed(0), random.Random(1)
    L, V = model.cfg.canvas_length, model.cfg.vocab_size
    caches = []
    for _ in range(11):
        c = KVCache(model.cfg)
        model.encode(torch.tensor([[2] + [rng.randrange(3, 96) for _ in range(rng.randrange(1, 10))]]), c)
        caches.append(c)
    canvas = torch.randint(0, V, (len(caches), L), generator=g)
    sc = [None if r % 3 == 0 else torch.randn(L, V, generator=g) * 3 for r in range(len(caches))]
    batched = model.denoise_rows(canvas, caches, sc)
    for r in range(len(caches)):
        assert torch.equal(batched[r], model.denoise_rows(canvas[r:r + 1], caches[r:r + 1], sc[r:r + 1])[0]), r
