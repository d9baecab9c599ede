"""Tokenizer: the only place that knows special token ids and chat templates.

Wraps a `tokenizers` `tokenizer.json`. Special tokens come from the model config (mask, EOS) and
`tokenizer_config.json` (BOS, pad, chat template) when present.

User text never becomes special ids: `encode` treats "<|mask|>", "<|eos|>" or a role marker
inside a prompt or a message as plain text, so a client cannot inject canvas masks or forge chat
turns. Only the chat template's own markup (`encode_chat`) is read with special tokens.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Iterable, Optional, Sequence

from tokenizers import Tokenizer as HFTokenizer

from celeris.engine.config import ModelConfig, read_json
from celeris.engine.errors import FieldViolation, InvalidRequest, ModelLoadError

MASK_MARKER = "\u2592"  # how a still-masked position renders in snapshot text
# End-of-turn tokens of the families we serve: generation stops at them like at EOS.
_END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<eos>")

# Used when a checkpoint ships no template (celeris-tiny's own format).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def stop_cut(ids: Iterable[int], stop_ids: frozenset[int], mask_id: Optional[int] = None) -> int:
    """Length of the prefix of `ids` before the first stop token (or, given `mask_id`, the first
    still-masked position). The one stop-cut rule: every "ids up to the first stop" uses it.

    It runs on every request's event of every step, in the step worker: one C-level `index`
    scan per stop id, each bounded by the cut found so far, instead of a Python loop over the
    canvas (at gen_length 256 and batch 32 that loop cost about a millisecond a step)."""
    seq = ids if isinstance(ids, (list, tuple)) else list(ids)
    n = len(seq)
    for t in stop_ids if mask_id is None else (*stop_ids, mask_id):
        try:
            n = seq.index(t, 0, n)
        except ValueError:
            pass
    return n


class Tokenizer:
    def __init__(self, tok: HFTokenizer, cfg: ModelConfig, tokenizer_config: dict | None = None):
        self._tok = tok  # template markup: special tokens recognised
        self._plain = HFTokenizer.from_str(tok.to_str())  # user text: special tokens are plain text
        self._plain.encode_special_tokens = True
        tc = tokenizer_config or {}
        self.vocab_size = cfg.vocab_size
        self.mask_id = cfg.mask_token_id
        self.eos_id = cfg.eos_token_id
        self.bos_id = self._special_id(tc.get("bos_token"))
        self.add_bos = bool(tc.get("add_bos_token", False)) and self.bos_id is not None
        self.pad_id = self._special_id(tc.get("pad_token"))
        if self.pad_id is None:
            self.pad_id = self.eos_id
        stop = {self.eos_id, *getattr(cfg, "eos_token_ids", ())}  # DiffusionGemma names several
        for t in _END_OF_TURN:
            tid = tok.token_to_id(t)
            if tid is not None and tid != self.mask_id:
                stop.add(tid)
        self.stop_ids = frozenset(stop)
        self.chat_template = tc.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        self._special = frozenset({self.mask_id, self.eos_id, self.pad_id, *(i for i in [self.bos_id] if i is not None)})
        # The longest vocabulary entry bounds how much text one token can cover: a text longer
        # than max_prompt_tokens * this is too long before it is tokenized.
        self.max_token_chars = max((len(t) for t in tok.get_vocab(with_added_tokens=False)), default=1)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids `decode` drops (mask, EOS, pad, BOS): they add no text, whatever surrounds them."""
        return self._special

    def _special_id(self, token: object) -> int | None:
        if isinstance(token, dict):  # {"content": "<s>", ...} form
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    @classmethod
    def from_dir(cls, folder: str | Path, cfg: ModelConfig) -> Tokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in model folder {folder}")
        return cls(HFTokenizer.from_file(str(path)), cfg, read_json(folder, "tokenizer_config.json"))

    def to_json(self) -> str:
        """The tokenizer.json text (structured outputs build their token masks from it)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        """User text to ids, special-token markers included as plain text (BOS added if configured)."""
        ids = self._ids(self._plain, text)
        return [self.bos_id, *ids] if self.add_bos else ids

    @staticmethod
    def _ids(tok: HFTokenizer, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a worker thread can tokenize while
        # the event loop keeps serving.
        return tok.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the chat template applied to `messages`: the template's markup is read with its
        special tokens, each message's content as plain text (placed through placeholders)."""
        marks = [f"\ue000{secrets.token_hex(8)}:{i}\ue001" for i in range(len(messages))]
        text = self.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                        add_generation_prompt, contents=[m.get("content") for m in messages])
        ids: list[int] = [self.bos_id] if self.add_bos else []
        for i, mark in enumerate(marks):
            head, found, text = text.partition(mark)
            if not found:  # the template dropped or rewrote a content: nothing user-written is lost
                raise InvalidRequest([FieldViolation(f"messages[{i}]", "the chat template does not place this message")])
            ids += self._ids(self._tok, head) + self._ids(self._plain, messages[i]["content"])
        return ids + self._ids(self._tok, text)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        ids = [i for i in ids if not (skip_special and i in self._special)]
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def stop_finder(self, stops: Sequence[str]):
        """ids -> (length of the shortest prefix whose text holds a stop string, that string), or
        None: the engine's stop-string check, run when a block finishes (bisection over prefixes)."""
        def find(ids: list[int]):
            text = self.decode(ids)
            found = [(text.find(s), s) for s in stops if s in text]
            if not found:
                return None
            first = min(found)[1]
            lo, hi = 1, len(ids)  # the shortest prefix whose text holds the first stop string
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if first in self.decode(ids[:mid]) else (mid + 1, hi)
            return lo, first
        return find

    def decode_cut(self, ids: Sequence[int], stop: str = "") -> str:
        """Text of `ids`, cut where the stop string that ended them begins (if any)."""
        text = self.decode(ids)
        return text[:text.find(stop)] if stop and stop in text else text

    def until_stop(self, ids: Iterable[int]) -> list[int]:
        """Generated ids up to (without) the first stop token or still-masked position."""
        ids = list(ids)
        return ids[:stop_cut(ids, self.stop_ids, self.mask_id)]

    def token_text(self, token_id: int) -> str:
        if token_id == self.mask_id:
            return MASK_MARKER
        return self._tok.decode([token_id], skip_special_tokens=False)

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in ids]

    def render(self, ids: Sequence[int]) -> str:
        """Text of a partly masked canvas: runs of real tokens decoded, each mask as MASK_MARKER."""
        out, run = [], []
        for i in ids:
            if i == self.mask_id:
                if run:
                    out.append(self.decode(run))
                    run = []
                out.append(MASK_MARKER)
            else:
                run.append(i)
        if run:
            out.append(self.decode(run))
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            contents: Sequence[object] | None = None) -> str:
        """The template rendered as text (for display; `encode_chat` is what generation uses)."""
        import jinja2  # only chat requests pay for it

        for i, m in enumerate(messages):
            content = m.get("content") if contents is None else contents[i]
            if not isinstance(m.get("role"), str) or not isinstance(content, str) or not m["role"]:
                raise InvalidRequest([FieldViolation(f"messages[{i}]", "needs a non-empty role and a content string")])
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        specials = {"bos_token": self._tok.id_to_token(self.bos_id) if self.bos_id is not None else "",
                    "eos_token": self._tok.id_to_token(self.eos_id) or ""}
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **specials)

    def check_ids(self, ids: Sequence[int], field: str = "token_ids") -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size or i == self.mask_id]
        if bad:
            raise InvalidRequest([FieldViolation(
                field, f"ids must be in [0, {self.vocab_size}) and not the mask id {self.mask_id}; bad: {bad[:5]}")])
