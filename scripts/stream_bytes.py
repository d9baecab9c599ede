"""Bytes and build time of Generate's messages, full vs delta, for one request (offline engine).

    python scripts/stream_bytes.py MODEL_DIR --gen-length 256 --steps 256 --block-length 32

Runs the request once through the step loop, feeds every event to a full and a delta
`celeris.server.grpc.convert.ChoiceFormatter` (as the step worker does), and prints messages, bytes per
request (`ByteSize()` summed) and the mean build time per message of each; the third row is a
delta stream that also carries the block's provisional predictions (StreamOptions.provisional).
"""

from __future__ import annotations

import argparse
import time

from celeris.v1 import generation_pb2 as pb
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM, Request
from celeris.engine.serving import Engine
from celeris.engine.sampling.params import SamplingParams
from celeris.server.grpc.convert import ChoiceFormatter, StreamPlan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", default="It is a truth universally acknowledged")
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stop-at-eos", action="store_true", help="let EOS end the request (default: every step runs)")
    a = ap.parse_args()
    llm = LLM.load(a.model, EngineConfig(max_gen_length=a.gen_length, max_batch=1, max_queue=1))
    prepared = Engine(llm).prepare_now(Request(prompt=a.prompt, params=SamplingParams(
        gen_length=a.gen_length, steps=a.steps, block_length=a.block_length, seed=a.seed,
        ignore_eos=not a.stop_at_eos, provisional=True)))  # changes no token; only the third row sends them
    events = []
    llm.loop.add(prepared.seq, bounded=False)
    llm.loop.run_to_completion(events.append)
    for name, delta, guesses in (("full", False, False), ("delta", True, False), ("delta+provisional", True, True)):
        fmt = ChoiceFormatter(StreamPlan(pb.STREAM_MODE_UNSPECIFIED, 1, delta, guesses), llm.tokenizer, 0, prepared)
        t0 = time.perf_counter()
        msgs = [fmt(ev) for ev in events]
        spent = time.perf_counter() - t0
        mid = [m for m in msgs[:-1] if m is not None]
        sizes = [m.ByteSize() for m in msgs if m is not None]
        print(f"{name:17s}: {len(sizes)} messages, {sum(sizes)} B per request, "
              f"{sum(sizes[:-1]) / max(1, len(mid)):.0f} B per message before the last, "
              f"{1e6 * spent / len(msgs):.0f} us per message built")


if __name__ == "__main__":
    main()
