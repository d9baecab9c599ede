"""Tokenizer: the only place that knows special token ids and chat templates.

Wraps a `tokenizers` `tokenizer.json`. Special tokens come from the model config (mask, EOS) and
`tokenizer_config.json` (BOS, pad, chat template) when present.

User text never becomes special ids: `encode` treats "<|mask|>", "<|eos|>" or a role marker
inside a prompt or a message as plain text, so a client cannot inject canvas masks or forge chat
turns. Only the chat template's own markup (`encode_chat`) is read with special tokens.
"""

from __future__ import annotations

import functools
import json
import secrets
from pathlib import Path
from typing import Iterable, Optional, Sequence

from tokenizers import Tokenizer as HFTokenizer

from celeris.engine.config import ModelConfig, read_json
from celeris.engine.errors import FieldViolation, InvalidRequest, ModelLoadError

MASK_MARKER = "\u2592"  # how a still-masked position renders in snapshot text
# End-of-turn tokens of the families we serve: generation stops at them like at EOS.
_END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<eos>")

# Used when a checkpoint ships no template (celeris-tiny's own format). Plain chats render as
# "<|role|>\ncontent\n" per message; with `tools` it lists them and asks for hermes-style calls
# (engine/agents/parsers.py "hermes"), an assistant's `tool_calls` render as <tool_call> blocks and a
# tool result as a <tool_response> block in a user turn (as Qwen's templates do).
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\nYou may call one or more functions. Their signatures, within "
    "<tools></tools>:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\nFor each call, "
    "write a JSON object with the function's name and arguments within <tool_call></tool_call>:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|user|>\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response>\n{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|assistant|>\n"
    "{% if m['content'] %}{{ m['content'] }}\n{% endif %}{% for c in m['tool_calls'] %}"
    "{% set f = c['function'] if c['function'] is defined else c %}<tool_call>\n{\"name\": \"{{ f['name'] }}\", "
    "\"arguments\": {{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}\n</tool_call>\n"
    "{% endfor %}{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# Markers chat templates write around tool calls and results (hermes/Qwen, celeris-tiny's own,
# LLaDA2's): where the vocabulary has no special token for one, a message's content spells it a
# character at a time (`Tokenizer._content_ids`), so user text never tokenizes to the template's.
TOOL_MARKERS = ("<tool_response>", "</tool_response>", "<tool_call>", "</tool_call>", "<tools>", "</tools>")


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
        self._templates: dict[str, object] = {}  # template text -> compiled (`_compiled`)
        self._texts: dict[int, str] = {}  # token id -> `token_text` (at most the vocabulary's ids)
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

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Optional[Sequence[dict]] = None) -> list[int]:
        """Ids of the chat template applied to `messages` (and `tools`, OpenAI-shaped dicts): the
        template's markup is read with its special tokens, each message's content as plain text
        (placed through placeholders). Tool names, arguments and schemas the template writes as
        markup may not hold a special token's text (checked in `apply_chat_template`)."""
        marks = [f"\ue000{secrets.token_hex(8)}:{i}\ue001" if isinstance(m.get("content"), str) else None
                 for i, m in enumerate(messages)]
        text = self.apply_chat_template([{**m, "content": mark} if mark else m for m, mark in zip(messages, marks)],
                                        add_generation_prompt, contents=[m.get("content") for m in messages],
                                        tools=tools)
        ids: list[int] = [self.bos_id] if self.add_bos else []
        for i, mark in enumerate(marks):
            if mark is None:
                continue
            head, found, text = text.partition(mark)
            if not found:  # the template dropped or rewrote a content: nothing user-written is lost
                raise InvalidRequest([FieldViolation(f"messages[{i}]", "the chat template does not place this message")])
            ids += self._ids(self._tok, head) + self._content_ids(messages[i]["content"])
        return ids + self._ids(self._tok, text)

    def _content_ids(self, content: str) -> list[int]:
        """A message's content as plain text, each tool marker in it (TOOL_MARKERS that are not
        special tokens here) spelled a character at a time: the same text, never the ids the
        template's own markers have, so a user turn cannot forge a tool result or call."""
        escape = self._escaped_markers
        if not escape or not any(m in content for m in escape):
            return self._ids(self._plain, content)
        ids: list[int] = []
        for part in escape["pattern"].split(content):
            ids += escape[part] if part in escape else self._ids(self._plain, part)
        return ids

    @functools.cached_property
    def _escaped_markers(self) -> dict:
        """Marker text -> its ids a character at a time, for each TOOL_MARKERS entry this
        vocabulary has no special token for and whose spelled-out ids decode to the same text and
        differ from the template's (checked here, once); "pattern": the regex that finds them."""
        import re

        out: dict = {}
        for m in TOOL_MARKERS:
            if m in self._markers:
                continue  # a special token: plain text already cannot produce it
            spelled = [i for c in m for i in self._ids(self._plain, c)]
            if self._tok.decode(spelled, skip_special_tokens=False) == m and spelled != self._ids(self._tok, m):
                out[m] = spelled
        if out:
            out["pattern"] = re.compile("(" + "|".join(re.escape(m) for m in sorted(out, key=len, reverse=True)) + ")")
        return out

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
        """One token's own text (the mask as MASK_MARKER). Every streamed message reads it for each
        token it carries (a final message: every canvas position), so each id is decoded once."""
        text = self._texts.get(token_id)
        if text is None:
            if token_id == self.mask_id:
                return MASK_MARKER
            text = self._tok.decode([token_id], skip_special_tokens=False)
            if type(token_id) is int and 0 <= token_id < self.vocab_size:  # never grows past the vocabulary
                self._texts[token_id] = text
        return text

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
                            contents: Sequence[object] | None = None, tools: Optional[Sequence[dict]] = None,
                            **extra) -> str:
        """The template rendered as text (for display; `encode_chat` is what generation uses), as
        transformers renders it: `tools` (OpenAI-shaped dicts) and any `extra` variables (e.g.
        enable_thinking) passed in, a message's `tool_calls` (their arguments as objects where the
        client sent JSON text) and `tool` messages (`tool_call_id`, `name`) given to the template."""
        messages = [self._chat_message(m, i, None if contents is None else contents[i]) for i, m in enumerate(messages)]
        self._no_markup(tools, "tools")
        specials = {"bos_token": self._tok.id_to_token(self.bos_id) if self.bos_id is not None else "",
                    "eos_token": self._tok.id_to_token(self.eos_id) or ""}
        try:
            return self._compiled(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=list(tools) if tools else None,
                **specials, **extra)
        except RecursionError:  # requests.py bounds nesting first; a template's own recursion still ends here
            raise InvalidRequest([FieldViolation("messages", "nest too deeply for the chat template")]) from None

    def _compiled(self, template: str):
        """The chat template compiled once (parsing and compiling one took ~4 ms, every request),
        keyed by its text: `--chat-template` may replace it after load. Rendering a compiled
        template is safe from several threads; two threads compiling the same one at once only
        repeat work."""
        compiled = self._templates.get(template)
        if compiled is None:
            import jinja2  # only chat requests pay for it
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(keep_trailing_newline=True, undefined=jinja2.Undefined)
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            compiled = env.from_string(template)
            if len(self._templates) >= 4:  # a template replaced more than a few times: keep the newest
                self._templates.clear()
            self._templates[template] = compiled
        return compiled

    def _chat_message(self, m: object, i: int, content: object) -> dict:
        """One message as the template gets it; InvalidRequest naming it when it cannot be one."""
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidRequest([FieldViolation(f"messages[{i}]", "needs a non-empty role and a content string")])
        content = m.get("content") if content is None and "content" in m else content
        calls = m.get("tool_calls")
        if not isinstance(content, str) and not (calls and content is None):
            raise InvalidRequest([FieldViolation(f"messages[{i}]", "needs a non-empty role and a content string")])
        if not calls:
            self._no_markup([m.get("name"), m.get("tool_call_id")], f"messages[{i}]")
            return m
        if not isinstance(calls, (list, tuple)) or not all(isinstance(c, dict) for c in calls):
            raise InvalidRequest([FieldViolation(f"messages[{i}].tool_calls", "must be a list of tool calls")])
        out = []
        for c in calls:  # OpenAI sends arguments as JSON text; templates (and transformers) expect objects
            fn = c.get("function") if isinstance(c.get("function"), dict) else {}
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except RecursionError:  # requests.py refuses such arguments before they get here
                    raise InvalidRequest([FieldViolation(f"messages[{i}].tool_calls", "arguments nest too deeply")]) \
                        from None
                except ValueError:
                    pass
            out.append({**c, "function": {**fn, "arguments": args}})
        self._no_markup(out, f"messages[{i}].tool_calls")
        return {**m, "content": m.get("content"), "tool_calls": out}  # the placeholder encode_chat finds

    def _no_markup(self, value: object, field: str) -> None:
        """Text the template writes as markup (tool schemas, call names and arguments) must not
        hold a special token's text: it would be read as that token (a forged turn)."""
        if value is None:
            return
        text = json.dumps(value, ensure_ascii=False)
        hit = next((t for t in self._markers if t in text), None)
        if hit is not None:
            raise InvalidRequest([FieldViolation(field, f"holds the special token {hit!r}, which only the chat "
                                                        "template may write")])

    @functools.cached_property
    def _markers(self) -> tuple[str, ...]:
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    @functools.cached_property
    def special_markers(self) -> dict[str, int]:
        """Text -> id of every added token (a chat format's markers among them, e.g. Qwen's
        `<tool_call>`, Gemma 4's `<|tool_call>`): llguidance treats each as a special token that no
        text literal matches, so a tool-call grammar writes them as token references
        (engine/agents/parsers.py `literal`)."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}

    def decode_markup(self, ids: Iterable[int]) -> str:
        """Text of generated ids keeping the special tokens a chat format writes (tool-call and
        channel markers such as Gemma 4's `<|tool_call>`), dropping only mask, EOS, pad and BOS:
        what the tool-call and reasoning parsers read."""
        return self._tok.decode([i for i in ids if i not in self._special], skip_special_tokens=False)

    def check_ids(self, ids: Sequence[int], field: str = "token_ids") -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size or i == self.mask_id]
        if bad:
            raise InvalidRequest([FieldViolation(
                field, f"ids must be in [0, {self.vocab_size}) and not the mask id {self.mask_id}; bad: {bad[:5]}")])


def _tojson(value: object, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson` for chat templates: plain JSON, not HTML-escaped."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    """A template's `raise_exception(...)`: the request is refused, naming the messages."""
    raise InvalidRequest([FieldViolation("messages", f"the chat template refuses them: {str(message)[:200]}")])
