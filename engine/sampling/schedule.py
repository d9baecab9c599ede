"""The fixed commit schedules, in plain Python: how many masked positions a step commits.

LLaDA spreads a block's masks evenly over its steps (`transfer_schedule`); Dream follows its
timestep ratio (`dream_transfer_count`). Per-request state (engine/loop/sequence.py) reads these
every step without touching the torch sampler.
"""

from __future__ import annotations

import functools
import struct


def transfer_schedule(n_masked: int, steps: int) -> list[int]:
    """Tokens to commit at each of `steps` steps: n//S each, plus one in the first n%S steps."""
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def _f32(x: float) -> float:
    """Round a double to float32. One IEEE op on float32 inputs computed in double and rounded
    once gives exactly the float32 result, so this reproduces torch's float32 scalar maths."""
    return struct.unpack("f", struct.pack("f", x))[0]


@functools.lru_cache(maxsize=256)
def _dream_timesteps(steps: int, eps: float) -> tuple[float, ...]:
    # torch's own float32 linspace, once per (steps, eps): its values depend on how the kernel
    # vectorises (fused multiply-add in the SIMD body, not in the tail), so no Python formula
    # reproduces Dream's timesteps bit for bit on every CPU. Imported here, not at the top, so
    # the schedules stay importable without torch's sampler.
    import torch

    return tuple(torch.linspace(1, eps, steps + 1, dtype=torch.float32).tolist())


def dream_transfer_count(n_masked: int, step: int, steps: int, eps: float) -> int:
    """Dream's `diffusion_generate` schedule: at step i of S, with t, s = timesteps[i], [i+1]
    of linspace(1, eps, S+1), commit int(n * (1 - s/t)) of the n still-masked positions, and
    every remaining one at the last step. float32 throughout, as Dream computes it."""
    if step >= steps - 1:
        return n_masked
    ts = _dream_timesteps(steps, eps)
    ratio = _f32(1.0 - _f32(ts[step + 1] / ts[step]))
    return int(_f32(float(n_masked) * ratio))
