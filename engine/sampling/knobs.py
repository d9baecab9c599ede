"""The knob table: every sampling knob, derived from `SamplingParams`' fields.

Each `Knob` carries the field's name, kind, default, choices and help, and its name on each
surface (HTTP body field, CLI flag, GenerateRequest field). The HTTP parser, the CLI flags and
the gRPC converter read their knob names from here; the client's keywords, the web page's controls
and the proto are checked against it by tests/unit/sampling/test_knobs.py, and `docs/sampling.md` is
generated from it (`python -m celeris.engine.sampling.knobs > docs/sampling.md`). Adding a knob: a `SamplingParams`
field (with `knob(...)`), a column of `SamplingBatch`, the proto field, its use in the sampler.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Any, Optional

from celeris.engine.sampling.params import (DECODING_MODES, FACTOR_RULES, KV_CACHE_MODES, REMASKING, SCHEDULES,
                                            SamplingParams)

INT, FLOAT, BOOL, CHOICE, STRINGS, IDS = "int", "float", "bool", "choice", "strings", "ids"
_KINDS = {"int": INT, "float": FLOAT, "bool": BOOL, "str": CHOICE, "tuple[str, ...]": STRINGS,
          "tuple[int, ...]": IDS}
CHOICES = {"remasking": REMASKING, "factor_rule": FACTOR_RULES, "schedule": SCHEDULES, "kv_cache": KV_CACHE_MODES,
           "decoding": DECODING_MODES}


@dataclass(frozen=True)
class Knob:
    name: str  # the SamplingParams field
    kind: str  # INT, FLOAT, BOOL, CHOICE, STRINGS (list of strings) or IDS (list of token ids)
    default: Any
    help: str
    optional: bool  # None is a value: "off" (threshold, factor) or "the server decides" (seed, kv_cache)
    choices: tuple[str, ...] = ()
    http: Optional[str] = None  # OpenAI-style body field; None: not a plain body field
    cli: Optional[str] = None  # `celeris run` / `celeris generate` flag
    proto: Optional[str] = None  # GenerateRequest field
    per_request: bool = False  # never a model default
    only: Optional[str] = None  # the one decoder that reads it (MASK or REVISE); None: every one
    config: Optional[str] = None  # its key in generation_config.json ("a.b": b of object a); None: never read

    @property
    def python_type(self) -> type:
        return {INT: int, FLOAT: float, BOOL: bool, CHOICE: str, STRINGS: tuple, IDS: tuple}[self.kind]


def _knob(f) -> Knob:
    annotation = str(f.type)
    optional = annotation.startswith("Optional[")
    kind = _KINDS[annotation[len("Optional["):-1] if optional else annotation]
    m = f.metadata

    def surface(key: str, default: str) -> Optional[str]:
        return None if m[key] is None else (m[key] or default)

    return Knob(f.name, kind, f.default, m["help"], optional, CHOICES.get(f.name, ()),
                http=surface("http", f.name), cli=surface("cli", "--" + f.name.replace("_", "-")),
                proto=surface("proto", f.name), per_request=m["per_request"], only=m["only"],
                config=None if m["per_request"] else m["config"] or f.name)


KNOBS: tuple[Knob, ...] = tuple(_knob(f) for f in fields(SamplingParams))
BY_NAME = {k.name: k for k in KNOBS}


def on(surface: str, *kinds: str) -> tuple[Knob, ...]:
    """The knobs a surface ("http", "cli", "proto") carries, optionally of the given kinds."""
    return tuple(k for k in KNOBS if getattr(k, surface) is not None and (not kinds or k.kind in kinds))


def read_by(decoder: str) -> tuple[Knob, ...]:
    """The knobs a decoder (MASK or REVISE) reads: its own and those every decoder reads."""
    return tuple(k for k in KNOBS if k.only in (None, decoder))


def only(decoder: str) -> tuple[str, ...]:
    """The names of the knobs only this decoder reads (the other refuses them set)."""
    return tuple(k.name for k in KNOBS if k.only == decoder)


def configured(raw: dict[str, Any], knobs: tuple[Knob, ...]) -> dict[str, Any]:
    """What a checkpoint's generation_config.json (`raw`) sets of `knobs`, by field name: a key
    that is absent, or null for a knob that cannot be unset, leaves the knob alone; an integer
    given for a float knob is read as that float."""
    out: dict[str, Any] = {}
    for k in knobs:
        if k.config is None:
            continue
        *outer, key = k.config.split(".")
        where: Any = raw
        for name in outer:
            where = where.get(name) if isinstance(where, dict) else None
        if not isinstance(where, dict) or key not in where or (where[key] is None and not k.optional):
            continue
        value = where[key]
        out[k.name] = float(value) if k.kind == FLOAT and type(value) is int else value
    return out


def markdown() -> str:
    """docs/sampling.md: the table every surface follows."""
    rows = ["# Sampling knobs", "",
            "Generated from `engine/sampling/params.py` by `python -m celeris.engine.sampling.knobs > docs/sampling.md`; a test keeps it "
            "current. Unset knobs take the model's defaults (`generation_config.json`), then these.", "",
            "| knob | kind | default | HTTP | CLI | gRPC | what it does |", "|---|---|---|---|---|---|---|"]
    for k in KNOBS:
        kind = f"{k.kind}: {' / '.join(k.choices)}" if k.choices else k.kind
        cells = [f"`{k.name}`", kind, "unset" if k.default is None else f"`{k.default!r}`",
                 *(f"`{x}`" if x else "-" for x in (k.http, k.cli, k.proto)),
                 k.help + (" (per request, never a model default)" if k.per_request else "")]
        rows.append("| " + " | ".join(cells) + " |")
    rows += ["", "HTTP also takes OpenAI's `logprobs` / `top_logprobs` for `logprobs`, and the gRPC "
             "`StreamOptions.provisional` carries `provisional`."]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
