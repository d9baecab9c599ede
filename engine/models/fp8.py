"""FP8 (E4M3) weights: per-output-channel scales, packed one byte a weight, W8A8 matmuls (issue #46).

A weight (N, K) is stored as float8_e4m3fn with one float32 scale per output row: scale =
amax(row) / 448 (E4M3's largest finite value), so every row uses the format's whole range and an
all-zero row gets scale 1 (its values stay 0). Activations are quantised the same way per token
(one scale per row of x, computed at run time), so the product needs no calibration data:

    y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * wq[n, k]

On a CUDA GPU with FP8 matmuls (compute capability >= 8.9: Ada, Hopper, Blackwell) that is one
`torch._scaled_mm` with row-wise scales (scale_a (M, 1), scale_b (1, N), float32; bf16 out; the
second operand column-major, K and N multiples of 16, which packing pads to). Everywhere else the
*reference* path computes the same quantised values in float32 (dequantise both operands, one
matmul): what the tests and scripts/fp8_quality.py measure on the CPU. It is not offered for
serving: `LLM.load` refuses `quantization="fp8"` on a device without FP8 matmuls
(`check_fp8_device`). Shapes: M tokens, K input features, N output features, E experts.

What stays in the model dtype: embeddings, the LM head (vocabulary-sized: its rounding would land
on the logits directly, as vLLM also leaves it) and MoE routers (see KEEP).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from celeris.engine.errors import ModelLoadError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell
GROUPED_CAPABILITY = (9, 0)  # torch._scaled_grouped_mm's kernels
ALIGN = 16  # _scaled_mm: K and N multiples of 16
# Linears kept in the model dtype, by qualified name. The LM head (`lm_head`, MaskPredictor's
# `transformer.ff_out`) writes the logits directly. A router makes a discrete top-k choice: FP8
# noise near a tie swaps a token's whole expert (a jump, not a rounding error), and its weight
# (E x D) is too small for FP8 to save anything; LLaDA2's router already scores in float32.
KEEP = re.compile(r"(^|\.)(router|gate|lm_head)(\.|$)|^transformer\.ff_out$")
GROUPED = ("gate_up_proj", "down_proj")  # DiffusionGemma's 3-D expert weights, run by grouped_linear


def to_e4m3(t: torch.Tensor) -> torch.Tensor:
    """Saturating cast: values past +-448 become +-448 (E4M3FN has no infinity)."""
    return t.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3 over the last dim.  t (..., R, K) -> q (..., R, K) e4m3, scale (..., R) float32"""
    amax = t.abs().amax(dim=-1).float()  # (..., R)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # zero rows: scale 1, values 0
    return to_e4m3(t.float() / scale[..., None]), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(..., R, K) e4m3 and (..., R) -> float32 values"""
    return q.float() * scale[..., None]


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_capable(device: torch.device | str, need: tuple[int, int] = MIN_CAPABILITY) -> bool:
    """Whether `device` runs FP8 matmuls (a CUDA GPU of compute capability >= `need`)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= need


def check_fp8_device(device: str) -> None:
    """Raise ModelLoadError naming the device and why, unless it runs FP8 matmuls."""
    need = ".".join(map(str, MIN_CAPABILITY))
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ModelLoadError(
            f"quantization 'fp8' (--quantization fp8) needs a GPU with FP8 matmuls (NVIDIA compute capability "
            f"{need} or newer: Ada, Hopper, Blackwell); device {device!r} has none. Serve in bfloat16 or float32 "
            "there (the FP8 reference path on the CPU is for tests and quality figures, not serving)")
    if not torch.cuda.is_available():
        raise ModelLoadError(f"quantization 'fp8': torch {torch.__version__} finds no CUDA GPU for {device!r}")
    if not fp8_capable(dev):
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = _capability(index)
        raise ModelLoadError(
            f"quantization 'fp8': device {device!r} ({torch.cuda.get_device_name(index)}, compute capability "
            f"{major}.{minor}) has no FP8 matmuls; they need compute capability {need} or newer")


# ------------------------------------------------------------------ the matmuls


def kernel_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """The device path: one row-wise scaled FP8 GEMM.  xq (M, K), sx (M,), wq (N, K), sw (N,) -> (M, N)"""
    # wq is (N, K) row-major, so wq.t() is the column-major (K, N) operand _scaled_mm wants.
    out = torch._scaled_mm(xq, wq.t(), scale_a=sx[:, None], scale_b=sw[None, :], out_dtype=torch.bfloat16)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


def reference_mm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """The same quantised product on dequantised values in float32.  -> (M, N) out_dtype"""
    return F.linear(dequantize(xq, sx), dequantize(wq, sw)).to(out_dtype)


def _padded(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and columns of a packed (..., N, K) weight padded with zeros to multiples of ALIGN
    (padded rows get scale 1); the matmul's extra outputs are sliced off, its extra K add zero."""
    pad_n, pad_k = -q.shape[-2] % ALIGN, -q.shape[-1] % ALIGN
    if not (pad_n or pad_k):
        return q, scale
    q = F.pad(q.view(torch.uint8), (0, pad_k, 0, pad_n)).view(E4M3)  # e4m3 zero is the zero byte
    return q, F.pad(scale, (0, pad_n), value=1.0)


def _pick(call: Optional[bool], module: Optional[bool], x: torch.Tensor) -> bool:
    """The device path or the reference: the call's choice, else the module's, else the device's."""
    if call is not None:
        return call
    return fp8_capable(x.device) if module is None else module


def use_kernel(model: nn.Module, kernel: Optional[bool]) -> None:
    """Pin every packed module of `model` to the device path (True), the reference (False), or
    back to the device's choice (None): the GPU test and scripts/fp8_quality.py compare the two."""
    for m in model.modules():
        if isinstance(m, (Fp8Linear, Fp8Grouped)):
            m.kernel = kernel


class Fp8Linear(nn.Module):
    """An nn.Linear whose weight is packed E4M3 with per-output-channel scales; W8A8 forward."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = _padded(*quantize_rows(weight))
        self.register_buffer("qweight", q)  # (N', K') e4m3, N' and K' padded to ALIGN
        self.register_buffer("weight_scale", scale)  # (N',) float32
        self.register_buffer("bias", None if bias is None else bias.detach().clone())  # (N,) model dtype
        self.kernel: Optional[bool] = None  # None: the device path where the device has one (use_kernel)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        return cls(linear.weight.detach(), linear.bias)

    def forward(self, x: torch.Tensor, kernel: Optional[bool] = None) -> torch.Tensor:
        """x (..., K) -> (..., N). kernel: None picks the device path where the device has one."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)  # (M, K)
        pad_k = self.qweight.shape[1] - self.in_features
        if pad_k:
            flat = F.pad(flat, (0, pad_k))
        xq, sx = quantize_rows(flat)  # (M, K') e4m3, (M,) per token
        kernel = _pick(kernel, self.kernel, x)
        out = (kernel_mm if kernel else reference_mm)(xq, sx, self.qweight, self.weight_scale, x.dtype)
        out = out[:, :self.out_features]  # (M, N)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)  # a copy only where N was padded

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


class Fp8Grouped(nn.Module):
    """E expert weights (E, N, K) packed E4M3, one scale per expert and output row, run over
    consecutive runs of rows: DiffusionGemma's `grouped_linear` calls `grouped_linear` here."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.shape = weight.shape  # (E, N, K): what the expert code reads off its weight
        q, scale = _padded(*quantize_rows(weight))
        self.register_buffer("qweight", q)  # (E, N', K') e4m3
        self.register_buffer("weight_scale", scale)  # (E, N') float32
        self.kernel: Optional[bool] = None

    def grouped_linear(self, x: torch.Tensor, counts: torch.Tensor, kernel: Optional[bool] = None) -> torch.Tensor:
        """Rows [sum(counts[:e]), sum(counts[:e+1])) of x through expert e.  x (M, K), counts (E,) -> (M, N)"""
        E, N, K = self.shape
        pad_k = self.qweight.shape[-1] - K
        xq, sx = quantize_rows(F.pad(x, (0, pad_k)) if pad_k else x)  # (M, K') per token
        kernel = _pick(kernel, self.kernel, x)
        if kernel and hasattr(torch, "_scaled_grouped_mm") and fp8_capable(x.device, GROUPED_CAPABILITY):
            # one call, no host read (graph-safe); the (E, K', N') operand column-major per expert
            out = torch._scaled_grouped_mm(xq, self.qweight.transpose(1, 2), scale_a=sx, scale_b=self.weight_scale,
                                           offs=counts.cumsum(0).to(torch.int32), out_dtype=torch.bfloat16)
        else:  # one matmul per expert that got rows: a host read of the counts
            mm = kernel_mm if kernel else reference_mm
            parts, start = [], 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    parts.append(mm(xq[start:start + n], sx[start:start + n], self.qweight[e], self.weight_scale[e],
                                    torch.float32))
                start += n
            out = torch.cat(parts)
        return out[:, :N].to(x.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.shape[0]}, out_features={self.shape[1]}, in_features={self.shape[2]}, e4m3 per-channel"


@dataclass(frozen=True)
class Fp8Summary:
    """What `quantize_fp8` packed: counts, the Linears it kept, weight bytes before and after."""

    linears: int
    grouped: int
    kept: tuple[str, ...]
    bytes_before: int
    bytes_after: int


def _nbytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@torch.no_grad()
def quantize_fp8(model: nn.Module) -> Fp8Summary:
    """Replace, in place, every nn.Linear but those KEEP names with Fp8Linear and every 3-D expert
    weight named in GROUPED with Fp8Grouped, on the weights' own device (one layer's weights exist
    twice at a time). Covers the dense and MoE mask predictors (engine/models/transformer.py, moe.py)
    and DiffusionGemma's text model (engine/families/revise/model.py)."""
    linears = grouped = before = after = 0
    kept: list[str] = []
    for prefix, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            full = f"{prefix}.{name}" if prefix else name
            if not isinstance(child, nn.Linear):
                continue
            if KEEP.search(full):
                kept.append(full)
                continue
            packed = Fp8Linear.from_linear(child)
            setattr(module, name, packed)
            linears += 1
            before += _nbytes(child.weight, child.bias)
            after += _nbytes(packed.qweight, packed.weight_scale, packed.bias)
        for name in GROUPED:
            weight = module._parameters.get(name)
            if weight is not None and weight.dim() == 3:
                delattr(module, name)  # the parameter goes; a module of the same name takes its place
                packed = Fp8Grouped(weight.detach())
                setattr(module, name, packed)
                grouped += 1
                before += _nbytes(weight)
                after += _nbytes(packed.qweight, packed.weight_scale)
    return Fp8Summary(linears, grouped, tuple(kept), before, after)


__all__ = ["E4M3", "E4M3_MAX", "Fp8Grouped", "Fp8Linear", "Fp8Summary", "check_fp8_device", "dequantize",
           "fp8_capable", "kernel_mm", "quantize_fp8", "quantize_rows", "reference_mm", "to_e4m3", "use_kernel"]
