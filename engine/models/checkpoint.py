"""The one strict checkpoint reader every loader uses (`models.weights`, DiffusionGemma's
`families/revise/weights`, the tensor-parallel `parallel/shard`).

A folder holds `model.safetensors` or a sharded `model.safetensors.index.json`. `tensors` opens
each file once, memory-mapped, and walks its tensors; a loader maps each checkpoint name to its
model's names (and reads the whole tensor, or its rank's slice), and `StrictState` collects them
strictly: an unexpected or mis-shaped tensor is an error naming the tensor and its file, a tensor
the model expects and the folder lacks is an error naming the folder. Every message is a
`ModelLoadError`; the folder's JSON files are read by `config.read_json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence as Seq

import torch
from safetensors import safe_open

from celeris.engine.config import read_json
from celeris.engine.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype by its name (`DTYPES`), or a torch dtype as it is."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def checkpoint_folder(folder: str | Path) -> Path:
    """The checkpoint folder as a Path; an error when there is none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    return folder


def tensor_files(folder: str | Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = read_json(folder, INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{folder / INDEX}: not a safetensors index (no 'weight_map' object)")
        files = {name: folder / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise ModelLoadError(f"{folder / INDEX} names shard {f.name}, which is missing")
        return files
    single = folder / SINGLE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ModelLoadError(f"no {SINGLE} or {INDEX} in {folder}")


def tensors(folder: str | Path) -> Iterator[tuple[str, Path, Any]]:
    """(checkpoint name, its file, the open file) of every tensor, file by file: each file is
    opened once, memory-mapped, and a loader reads a tensor (`get_tensor`) or a slice of it
    (`get_slice`) while it is open."""
    by_file: dict[Path, list[str]] = {}
    for name, path in tensor_files(folder).items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                yield name, path, f


def _listed(names: Seq[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


class StrictState:
    """A model's state dict filled strictly from a checkpoint: every tensor `put` must be one the
    model expects (`expected`: name -> shape) at its shape, and `done` is an error unless every
    expected tensor came. `convert(name, tensor)` makes a stored tensor (dtype, device)."""

    def __init__(self, folder: str | Path, expected: Mapping[str, Seq[int]],
                 convert: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, t: t):
        self.folder, self.convert = Path(folder), convert
        self.expected = {name: tuple(shape) for name, shape in expected.items()}
        self.state: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def expect(self, name: str, ckpt_name: str, path: Path) -> tuple[int, ...]:
        """The shape the model expects of `name` (read from `ckpt_name` in `path`); an error when
        the model has no such tensor."""
        if name not in self.expected:
            raise ModelLoadError(f"unexpected tensor {ckpt_name!r} in {path.name}")
        return self.expected[name]

    def put(self, name: str, t: torch.Tensor, ckpt_name: str, path: Path) -> None:
        """Store `t` (checkpoint tensor `ckpt_name` in `path`, or its part) as the model's `name`."""
        want = self.expect(name, ckpt_name, path)
        if tuple(t.shape) != want:
            raise ModelLoadError(f"tensor {ckpt_name!r} in {path.name} has shape {tuple(t.shape)}, expected {want}")
        self.state[name] = self.convert(name, t)

    def done(self) -> dict[str, torch.Tensor]:
        """The state dict, once every tensor the model expects is in it."""
        missing = sorted(set(self.expected) - set(self.state))
        if missing:
            raise ModelLoadError(f"missing tensor(s) in {self.folder}: {_listed(missing)}")
        return self.state
