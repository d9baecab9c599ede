"""CUDA graphs of fixed-shape forwards, keyed by their bucket, and the policy that picks them.

A captured forward reads its inputs from static tensors and writes its output (and any cache
update) at static addresses; a replay copies the step's inputs in place and runs. Selection
is never captured: it runs after the replay on the output, so no sampling knob leaves the
graph path. Graphs pay off where the host's launch overhead dominates (few tokens a forward);
above `graph_max_tokens` fresh tokens a forward the kernels dominate and eager runs the exact
shape instead of a rounded-up bucket (the crossover is measured by scripts/bench_gpu.py).
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch


class GraphCache:
    """One captured graph per key: `run(key, inputs, fn)` returns fn(*inputs)'s output, replayed."""

    def __init__(self):
        self.graphs: dict[Hashable, tuple[Callable[[], None], tuple[torch.Tensor, ...], object]] = {}

    def __len__(self) -> int:
        return len(self.graphs)

    def __bool__(self) -> bool:
        return bool(self.graphs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.graphs

    def run(self, key: Hashable, inputs: Sequence[torch.Tensor], fn: Callable, harmless: Sequence[torch.Tensor]):
        """`harmless`: inputs of the same shapes that touch nothing real (padding rows), used for
        the warm-up and capture. The output is static: read it before the next replay."""
        if key not in self.graphs:
            static = tuple(h.clone() for h in harmless)
            replay, out = self.capture(fn, static)
            self.graphs[key] = (replay, static, out)
        replay, static, out = self.graphs[key]
        for s, x in zip(static, inputs):
            s.copy_(x)
        replay()
        return out

    @staticmethod
    def capture(fn: Callable, static: tuple[torch.Tensor, ...]) -> tuple[Callable[[], None], object]:
        """(replay, static output) of fn over the static inputs: a CUDA graph. (`eager_capture`
        stands in for it on the CPU, to run the whole graph path without a device.)"""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (allocator, kernels)
            for _ in range(2):
                fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*static)
        return graph.replay, out


def eager_capture(fn: Callable, static: tuple[torch.Tensor, ...]) -> tuple[Callable[[], None], object]:
    """The CPU rehearsal of `GraphCache.capture`: fn runs over the static inputs and each replay
    reruns it, writing the one static output in place as a graph's replay would."""
    out = fn(*static)
    return (lambda: out.copy_(fn(*static))), out


def use_graph(tokens: int, max_tokens: int) -> bool:
    """The bucket policy: graphs at or below `max_tokens` fresh tokens a forward (0: never)."""
    return 0 < tokens <= max_tokens
