"""Per-rank resident memory under tensor parallelism (docs/parallel.md, #32).

Writes a random LLaDA-shaped float32 checkpoint big enough for its weights to dominate a
process's memory (~190 MB), then, each in a fresh process: imports only (the baseline), loads
at size 1, loads at size N; each loaded engine decodes one short request first. Prints VmRSS,
RssAnon and RssFile (MiB) of every rank. Usage: python scripts/measure_tp_memory.py [N ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SHAPE = dict(d_model=768, n_heads=12, n_kv_heads=12, n_layers=5, mlp_hidden_size=2048, embedding_size=8192,
             vocab_size=8192)


def rss(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


def write_checkpoint(folder: Path) -> int:
    import torch

    from celeris.engine.config import ModelConfig
    from celeris.engine.models.transformer import MaskPredictor
    from celeris.engine.families.checkpoint import save_model

    torch.manual_seed(0)
    model = MaskPredictor(ModelConfig(arch="llada", mask_token_id=3, eos_token_id=2, **SHAPE))
    save_model(model, folder)
    from celeris.engine.llm import EMBEDDED_MODEL
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (EMBEDDED_MODEL / f).exists():
            (folder / f).write_bytes((EMBEDDED_MODEL / f).read_bytes())
    return (folder / "model.safetensors").stat().st_size


def measure(folder: str, tp: int) -> None:
    import torch

    torch.set_num_threads(1)
    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM

    if tp == 0:  # baseline: the imports alone
        print(json.dumps({"ranks": [rss(os.getpid())]}))
        return
    cfg = EngineConfig(max_batch=1, max_prompt_tokens=16, max_gen_length=16, tensor_parallel_size=tp)
    llm = LLM.load(folder, cfg)
    llm.generate_one([5, 6, 7], gen_length=8, steps=4, block_length=8)
    pids = [os.getpid()] + ([p.pid for p in llm.model.supervisor.procs] if tp > 1 else [])
    print(json.dumps({"ranks": [rss(p) for p in pids]}))
    llm.close()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--measure":
        return measure(sys.argv[2], int(sys.argv[3]))
    sizes = [int(x) for x in sys.argv[1:]] or [2]
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / "celeris-tp-memory"
    nbytes = write_checkpoint(folder)
    print(f"checkpoint: {nbytes / 2**20:.1f} MiB float32 ({SHAPE})")
    for tp in [0, 1, *sizes]:
        out = subprocess.run([sys.executable, __file__, "--measure", str(folder), str(tp)], check=True,
                             capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        ranks = json.loads(out.stdout.strip().splitlines()[-1])["ranks"]
        label = "imports only" if tp == 0 else f"size {tp}"
        for r, m in enumerate(ranks):
            print(f"{label:>12} rank {r}: VmRSS {m['VmRSS']:7.1f}  RssAnon {m['RssAnon']:7.1f}  RssFile {m['RssFile']:7.1f} MiB")


if __name__ == "__main__":
    main()
