"""Celeris against dlmserve 0.1.1, side by side on the same random LLaDA-format checkpoint and workload.

    python scripts/bench_dlmserve.py --llada-code /tmp/llada_remote --dlmserve-python /tmp/dlmvenv/bin/python
    python scripts/bench_dlmserve.py --llada-code DIR --cells 1:float32,1:bfloat16 --repeats 5
    python scripts/bench_dlmserve.py --llada-code DIR --big-vocab          # adds the 126,464-vocabulary fp32 cell

dlmserve 0.1.1 (pip `dlmserve`) runs LLaDA through transformers'
`AutoModel.from_pretrained(..., trust_remote_code=True)`, i.e. the checkpoint folder's own
`modeling_llada.py` / `configuration_llada.py` (GSAI-ML/LLaDA-8B-Instruct's remote code). That code
is not part of this repository: `--llada-code DIR` names a folder holding the two files, and they
are copied into the benchmark's checkpoint with the `auto_map` entries in its config.json.
dlmserve needs transformers < 5, so it runs in its own virtual environment (`--dlmserve-python`),
as a subprocess that loads the model once per dtype and runs each request batch on command
(a driver written to a temporary folder at run time; it answers one JSON line per command).

The checkpoint: random weights in LLaDA-8B-Instruct's format (tests/unit/references/checkpoints.py,
std 0.3: peaked logits like a trained model's), a small vocabulary (default 4,096 ids: celeris-tiny
v1's tokenizer, 1,024 ids with mask 3 and EOS 2, extended with byte-level tokens) and a few layers
of a small width. dlmserve's loader hard-codes LLaDA-8B's mask id (126,336) and its tokenizer's
`<|mdm_mask|>`, so `load_llada` is bypassed: the driver builds `LoadedLLaDA(model, tokenizer,
device, dtype, mask_id=<the checkpoint's>)` and an `Engine` around it with the attributes
`Engine.__init__` sets. Its tokenizer is a transformers `PreTrainedTokenizerFast` over the same
tokenizer.json; prompts go in pre-rendered (`prerendered=True`), and each prompt's text is checked
to tokenise to exactly the ids Celeris is given.

The workload, the same on both sides: dlmserve's defaults (gen_length 128, 128 steps, one block
of 128: one token a step), temperature 0, low-confidence remasking, a 32-token prompt, 1 or 8
requests at once (all prompts of one length, so dlmserve pads nothing: the remote code builds a
causal bias whenever its attention mask holds a 0). Celeris runs `LLM.generate` in this process
(KV cache off, the published reverse process; `ignore_eos` so every canvas position is kept for
the comparison; one block, so no request ends early either way); dlmserve runs `Engine.generate`.
Runs alternate between the two (ABBA: celeris, dlmserve, dlmserve, celeris, ...), one untimed
warm-up each per cell; the median wall time of `--repeats` runs per side is reported.

Throughput is canvas tokens per second: requests x gen_length / wall time of the whole call (both
sides run all steps, so the non-EOS count would differ only by the random model's EOS picks; it is
printed beside). Tokens: each side's 128 generated ids per request, compared position by position.
Where a request differs, the driver also runs LLaDA's reverse process as first published (float64
confidences, one request alone, on the transformers model; written here, not copied) and the report
says whose tokens it reproduces, and for batched cells whether each side's tokens for that request
alone are its batched ones. Two known causes: Celeris never commits the mask id (a random model can
rank it first; the published loop commits it and the position stays masked, spending that step),
and dlmserve takes the confidences' softmax in the logits' dtype (bf16 rounding makes ties that
torch.topk breaks by index), where the first published generate() takes it in float64.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.sampling.params import SamplingParams  # noqa: E402
from tests.unit.references.checkpoints import TINY_EOS, write_llada_checkpoint  # noqa: E402

MODELING_FILES = ("modeling_llada.py", "configuration_llada.py")
AUTO_MAP = {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"}
BIG_VOCAB = 126_464  # LLaDA-8B's vocabulary (and embedding) size
WORDS = ("the quick brown fox jumps over a lazy dog while seven small engines hum along river banks "
         "under grey skies and every careful reader counts tokens before lunch").split()


# ---------------------------------------------------------------------------------------- checkpoint

def _byte_alphabet() -> list[str]:
    """The 256 characters a byte-level BPE writes bytes as (GPT-2's printable mapping)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def extend_tokenizer(path: Path, vocab: int) -> None:
    """Grow a byte-level BPE tokenizer.json to `vocab` ids with two- and three-byte tokens (no
    merges reach them, so encoding is unchanged; they decode as their bytes)."""
    tok = json.loads(path.read_text())
    table: dict[str, int] = tok["model"]["vocab"]
    n = max(table.values()) + 1
    if n >= vocab:
        return
    alphabet = _byte_alphabet()
    pieces = (a + b for a in alphabet for b in alphabet)
    pieces3 = (a + b + c for a in alphabet for b in alphabet for c in alphabet)
    for piece in (*pieces, *pieces3) if vocab - n > 65_000 else pieces:
        if n >= vocab:
            break
        if piece not in table:
            table[piece] = n
            n += 1
    path.write_text(json.dumps(tok, ensure_ascii=False))


def write_checkpoint(folder: Path, args: argparse.Namespace, vocab: int) -> Path:
    """A random LLaDA-format checkpoint with the remote code beside it, as on the hub."""
    heads = args.d_model // args.head_dim
    write_llada_checkpoint(folder, torch.float32, seed=0, d_model=args.d_model, n_heads=heads, n_kv_heads=heads,
                           n_layers=args.layers, mlp_hidden_size=args.mlp, vocab_size=vocab, embedding_size=vocab,
                           max_sequence_length=4096)
    extend_tokenizer(folder / "tokenizer.json", vocab)
    add_remote_code(folder, args.llada_code)
    return folder


def add_remote_code(folder: Path, code: Optional[Path]) -> None:
    if code is not None:
        for name in MODELING_FILES:
            shutil.copy(Path(code) / name, folder / name)
    missing = [n for n in MODELING_FILES if not (folder / n).is_file()]
    if missing:
        sys.exit(f"{folder} lacks {', '.join(missing)}: pass --llada-code DIR "
                 "(GSAI-ML/LLaDA-8B-Instruct's remote code)")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = AUTO_MAP
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def make_prompts(tokenizer_json: Path, n: int, length: int) -> list[tuple[str, list[int]]]:
    """n distinct texts that each tokenise to exactly `length` ids (no special tokens)."""
    from tokenizers import Tokenizer as HFTokenizer
    tok = HFTokenizer.from_file(str(tokenizer_json))
    out: list[tuple[str, list[int]]] = []
    for i in range(n * 50):
        words, text = WORDS[i % len(WORDS):] + WORDS[:i % len(WORDS)], ""
        for w in words * 8:
            cand = (text + " " + w).strip() if text else f"{i} {w}"
            ids = tok.encode(cand, add_special_tokens=False).ids
            if len(ids) > length:
                break
            text = cand
            if len(ids) == length:
                if all(ids != o[1] for o in out):
                    out.append((text, ids))
                break
        if len(out) == n:
            return out
    sys.exit(f"could not build {n} prompts of {length} tokens")


# ---------------------------------------------------------------------------------------- dlmserve side

DRIVER = textwrap.dedent('''
    """dlmserve 0.1.1 driver: one JSON command a line on stdin, one '@@'-prefixed JSON reply a line on stdout."""
    import json, sys, time
    from pathlib import Path

    import torch

    folder, threads = Path(sys.argv[1]), int(sys.argv[2])
    if threads:
        torch.set_num_threads(threads)
    import transformers
    from transformers import AutoModel, PreTrainedTokenizerFast
    from dlmserve.engine import Engine
    from dlmserve.kv_cache import CacheConfig, DiffusionKVCache
    from dlmserve.models.llada import LoadedLLaDA
    from dlmserve.sampler import SamplingParams
    from dlmserve.scheduler import MAX_BATCH, DiffusionScheduler
    from importlib.metadata import version


    def reply(obj):
        print("@@" + json.dumps(obj), flush=True)


    cfg = json.loads((folder / "config.json").read_text())
    special = json.loads((folder / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                  **{k: special[k] for k in ("bos_token", "eos_token", "pad_token", "mask_token")
                                     if k in special})
    tok.padding_side = "left"  # as dlmserve's load_llada sets it
    engines = {}


    def engine_for(dtype):
        if dtype not in engines:
            engines.clear()
            model, info = AutoModel.from_pretrained(str(folder), trust_remote_code=True,
                                                    torch_dtype=getattr(torch, dtype), output_loading_info=True)
            bad = {k: v for k, v in info.items() if v}
            if bad:
                raise RuntimeError(f"weights did not load cleanly: {bad}")
            model.eval()
            device = next(model.parameters()).device
            loaded = LoadedLLaDA(model=model, tokenizer=tok, device=device, dtype="bf16", mask_id=cfg["mask_token_id"])
            eng = Engine.__new__(Engine)  # load_llada bypassed (it hard-codes LLaDA-8B's mask id and tokenizer)
            eng._loaded = loaded
            eng._scheduler = DiffusionScheduler(max_batch=MAX_BATCH)
            c = model.config
            eng._cache = DiffusionKVCache(CacheConfig(
                num_layers=getattr(c, "n_layers", getattr(c, "num_hidden_layers", 0)),
                num_heads=getattr(c, "n_heads", getattr(c, "num_attention_heads", 0)),
                head_dim=getattr(c, "head_dim", 0), max_seq_len=getattr(c, "max_position_embeddings", 4096)))
            eng._shutdown = False
            engines[dtype] = eng
        return engines[dtype]


    @torch.no_grad()
    def reference(model, prompt, mask_id, gen_length, steps, block_length):
        """LLaDA's published reverse process (low-confidence remasking, temperature 0), one request:
        x0 = argmax of the logits, confidence = float64 softmax probability of x0, the k most confident
        masked positions of the current block commit, k from an even split of the block's masks."""
        x = torch.full((1, len(prompt) + gen_length), mask_id, dtype=torch.long)
        x[0, :len(prompt)] = torch.tensor(prompt)
        per_block = steps // (gen_length // block_length)
        for nb in range(gen_length // block_length):
            lo, hi = len(prompt) + nb * block_length, len(prompt) + (nb + 1) * block_length
            masks = int((x[0, lo:hi] == mask_id).sum())
            counts = [masks // per_block + (1 if i < masks % per_block else 0) for i in range(per_block)]
            for k in counts:
                masked = x[0] == mask_id
                logits = model(x).logits[0]
                x0 = logits.argmax(dim=-1)
                conf = torch.gather(torch.softmax(logits.to(torch.float64), dim=-1), -1, x0[:, None])[:, 0]
                conf[hi:] = -float("inf")
                conf = torch.where(masked, conf, torch.tensor(-float("inf"), dtype=torch.float64))
                pick = torch.topk(conf, k).indices
                x[0, pick] = x0[pick]
        return x[0, len(prompt):].tolist()


    reply({"ready": True, "torch": torch.__version__, "transformers": transformers.__version__,
           "dlmserve": version("dlmserve"), "threads": torch.get_num_threads()})
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            eng = engine_for(msg["dtype"])
            if msg.get("reference"):
                m = eng._loaded
                reply({"tokens": [reference(m.model, i, m.mask_id, msg["gen_length"], msg["steps"], msg["block_length"])
                                  for i in msg["ids"]]})
                continue
            texts, ids = msg["texts"], msg["ids"]
            if msg.get("check"):
                got = [eng._encode([t], prerendered=True)[0][0].tolist() for t in texts]
                if got != ids:
                    raise RuntimeError("dlmserve tokenises the prompts differently from the ids Celeris is given")
            params = SamplingParams(num_denoising_steps=msg["steps"], gen_length=msg["gen_length"],
                                    block_length=msg["block_length"], temperature=0.0, seed=0)
            t0 = time.perf_counter()
            outs = eng.generate(texts, params, prerendered=True)
            wall = time.perf_counter() - t0
            reply({"wall_s": wall, "tokens": [o.output_ids.tolist() for o in outs]})
        except Exception as e:  # reported to the parent, which stops
            reply({"error": f"{type(e).__name__}: {e}"})
''')


class Dlmserve:
    def __init__(self, python: str, folder: Path, threads: int, workdir: Path):
        driver = workdir / "dlmserve_driver.py"
        driver.write_text(DRIVER)
        self.log = workdir / "dlmserve_driver.log"
        self.proc = subprocess.Popen([python, str(driver), str(folder), str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True, bufsize=1)
        self.info = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                sys.exit(f"dlmserve driver exited ({self.proc.poll()}); its log:\n{self.log.read_text()[-3000:]}")
            if line.startswith("@@"):
                out = json.loads(line[2:])
                if "error" in out:
                    sys.exit(f"dlmserve driver: {out['error']}\n{self.log.read_text()[-3000:]}")
                return out

    def run(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------- the comparison

@dataclass
class Cell:
    name: str
    requests: int
    dtype: str
    vocab: int
    celeris: list[float] = field(default_factory=list)
    dlmserve: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    agree: str = ""
    eos: tuple[int, int] = (0, 0)


def compare(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    if same == len(a):
        return f"identical ({len(a)}/{len(a)} requests)"
    pos = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y))
    total = sum(len(x) for x in a)
    first = min(next(i for i, (p, q) in enumerate(zip(x, y)) if p != q) for x, y in zip(a, b) if x != y)
    return (f"DIFFER: {same}/{len(a)} requests identical, {pos}/{total} positions equal, "
            f"first difference at position {first}")


def celeris_run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    seqs = [llm.request(p, params) for p in prompts]
    llm.run(seqs)
    wall = time.perf_counter() - t0
    return wall, [list(s.output) for s in seqs]


def run_cell(cell: Cell, llm: LLM, dlm: Dlmserve, prompts, args, progress) -> None:
    params = SamplingParams(gen_length=args.gen_length, steps=args.steps, block_length=args.block_length,
                            temperature=0.0, remasking="low_confidence", ignore_eos=True, seed=0)
    texts, ids = [t for t, _ in prompts], [i for _, i in prompts]
    msg = dict(dtype=cell.dtype, texts=texts, ids=ids, steps=args.steps, gen_length=args.gen_length,
               block_length=args.block_length)
    if [list(llm.request(i, params).prompt) for i in ids] != ids:  # the canvas starts with exactly these ids
        sys.exit("Celeris built a different prompt from the ids given")
    _, c_tok = celeris_run(llm, ids, params)  # warm-ups (untimed); dlmserve checks its tokenisation
    d_tok = dlm.run(check=True, **msg)["tokens"]
    cell.agree = compare(c_tok, d_tok)
    for i, (c, d) in enumerate(zip(c_tok, d_tok)):  # a difference: who follows the published process
        if c != d:
            ref = dlm.run(reference=True, **{**msg, "texts": [texts[i]], "ids": [ids[i]]})["tokens"][0]
            found = {"celeris": c, "dlmserve": d}
            if cell.requests > 1:
                found["celeris alone"] = celeris_run(llm, [ids[i]], params)[1][0]
                found["dlmserve alone"] = dlm.run(**{**msg, "texts": [texts[i]], "ids": [ids[i]]})["tokens"][0]
            same = [k for k, v in found.items() if v == ref]
            cell.agree += f"; request {i}: the published process's tokens = {', '.join(same) or 'neither side'}'s"
    cell.eos = (sum(t == TINY_EOS for x in c_tok for t in x), sum(t == TINY_EOS for x in d_tok for t in x))
    progress(f"{cell.name}: warm-up done; tokens {cell.agree}")
    tokens = cell.requests * args.gen_length
    for r in range(args.repeats):
        order = ("celeris", "dlmserve") if r % 2 == 0 else ("dlmserve", "celeris")
        for side in order:
            cell.load.append(os.getloadavg()[0])
            if side == "celeris":
                wall, _ = celeris_run(llm, ids, params)
                cell.celeris.append(wall)
            else:
                wall = dlm.run(**msg)["wall_s"]
                cell.dlmserve.append(wall)
            progress(f"{cell.name}: repeat {r + 1}/{args.repeats} {side:8s} {wall:7.3f} s  {tokens / wall:8.1f} tok/s"
                     f"  (load {cell.load[-1]:.2f})")


def parse_cells(spec: str) -> list[tuple[int, str]]:
    out = []
    for part in spec.split(","):
        n, dtype = part.split(":")
        out.append((int(n), {"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="an existing LLaDA-format checkpoint folder (default: write one)")
    ap.add_argument("--llada-code", type=Path, help="folder with LLaDA's modeling_llada.py and configuration_llada.py")
    ap.add_argument("--dlmserve-python", default="/tmp/dlmvenv/bin/python")
    ap.add_argument("--cells", default="1:float32,8:float32,1:bfloat16,8:bfloat16",
                    help="requests:dtype pairs on the small vocabulary")
    ap.add_argument("--big-vocab", action="store_true", help=f"add one request and 8 in fp32 with {BIG_VOCAB:,} ids")
    ap.add_argument("--big-cells", default="1:float32", help="cells run on the big vocabulary (with --big-vocab)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--mlp", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--block-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads on both sides (0: torch's default)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    start = time.perf_counter()

    def progress(text: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {text}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="bench_dlmserve_"))
    folders: dict[int, Path] = {}
    if args.model is not None:
        add_remote_code(args.model, args.llada_code)
        folders[json.loads((args.model / "config.json").read_text())["vocab_size"]] = args.model
    else:
        folders[args.vocab] = write_checkpoint(work / f"llada-{args.vocab}", args, args.vocab)
    if args.big_vocab:
        folders[BIG_VOCAB] = write_checkpoint(work / f"llada-{BIG_VOCAB}", args, BIG_VOCAB)
    plan = [(folders[min(folders)], c) for c in parse_cells(args.cells)]
    if args.big_vocab:
        plan += [(folders[BIG_VOCAB], c) for c in parse_cells(args.big_cells)]

    cells: list[Cell] = []
    versions: dict = {}
    try:
        for folder in dict.fromkeys(f for f, _ in plan):
            vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
            progress(f"checkpoint {folder} (vocabulary {vocab:,}); starting dlmserve's driver")
            dlm = Dlmserve(args.dlmserve_python, folder, args.threads, work)
            versions = dlm.info
            for dtype in dict.fromkeys(d for f, (_, d) in plan if f == folder):
                llm = LLM.load(folder, EngineConfig(dtype=dtype))
                for n, _ in [c for f, c in plan if f == folder and c[1] == dtype]:
                    prompts = make_prompts(folder / "tokenizer.json", n, args.prompt_len)
                    cell = Cell(f"{dtype} vocab {vocab:,} x{n}", n, dtype, vocab)
                    run_cell(cell, llm, dlm, prompts, args, progress)
                    cells.append(cell)
            dlm.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nCeleris in-process LLM.generate vs dlmserve {versions.get('dlmserve')} Engine.generate "
          f"(torch {torch.__version__}, transformers {versions.get('transformers')}; threads: celeris "
          f"{torch.get_num_threads()}, dlmserve {versions.get('threads')})")
    print(f"model: d_model {args.d_model}, {args.layers} layers, {args.d_model // args.head_dim} heads, "
          f"mlp {args.mlp}; "
          f"prompt {args.prompt_len}, gen {args.gen_length}, steps {args.steps}, block {args.block_length}, "
          f"temperature 0, low_confidence; median of {args.repeats}, alternating")
    print(f"{'cell':28s} {'celeris tok/s':>14s} {'dlmserve tok/s':>15s} {'ratio':>6s}  {'load':>9s}  tokens")
    rows = []
    for c in cells:
        tok = c.requests * args.gen_length
        cel, dlm_s = statistics.median(c.celeris), statistics.median(c.dlmserve)
        ratio = dlm_s / cel
        print(f"{c.name:28s} {tok / cel:14.1f} {tok / dlm_s:15.1f} {ratio:5.2f}x  {min(c.load):.1f}-{max(c.load):.1f}"
              f"  {c.agree}; EOS ids generated: {c.eos[0]} / {c.eos[1]}")
        rows.append({"cell": c.name, "requests": c.requests, "dtype": c.dtype, "vocab": c.vocab,
                     "celeris_s": c.celeris, "dlmserve_s": c.dlmserve, "celeris_tok_s": tok / cel,
                     "dlmserve_tok_s": tok / dlm_s, "ratio": ratio, "load": c.load, "tokens": c.agree})
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions,
                                         "cells": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
