"""What the agent endpoint costs per model call (docs/agentic.md, "Agent programs"): the same
calls made directly on the HF engine and through the endpoint by agent programs with the
official openai client, alternately in one process, so background load hits both alike.

- direct: `engine.generate_ids` on B prompts of the same token ids, `--calls` times;
- endpoint: B sync agents (threads, envs/agent_host.py), each making `--calls` completions calls
  on that prompt's text; the host batches whatever calls are waiting into one engine call.
Per call = wall time / (B x calls). The ratio endpoint / direct is the number to read (STYLE.md);
`overhead_ms` is their difference per call. Best of `--repeats` after one warm-up of each. The
model: `--model` (default: the demo's shape built untrained in a temp dir; speed only).

Prints one JSON line:
    {"model", "calls", "max_new_tokens", "repeats", "direct_ms": {B: ...}, "endpoint_ms": {B: ...},
     "ratio": {B: ...}, "overhead_ms": {B: ...}}

    python scripts/bench_agent_endpoint.py [--model DIR] [--batches 1,16] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollflash.envs import Item  # noqa: E402
from rollflash.envs.agent import Agent, CallParams, Codec  # noqa: E402
from rollflash.envs.agent_host import AgentHost  # noqa: E402
from rollflash.envs.agent_protocol import Limits  # noqa: E402
from rollflash.generators.hf_engine import HFEngine  # noqa: E402
from rollflash.generators.sampling import SamplingParams  # noqa: E402

PROMPT = "17+25="


def direct(engine: HFEngine, batch: int, calls: int, tokens: int) -> float:
    """Seconds per call, engine.generate_ids on `batch` copies of the prompt's ids."""
    ids = Codec(engine.tokenizer, None).encode_prompt(PROMPT)
    params = SamplingParams(1, 1.0, 1.0, tokens)
    started = time.perf_counter()
    for _ in range(calls):
        engine.generate_ids([ids] * batch, params)
    return (time.perf_counter() - started) / (batch * calls)


def endpoint(engine: HFEngine, batch: int, calls: int, tokens: int) -> float:
    """Seconds per call, `batch` agents making `calls` completions calls each."""

    def agent(client, item):
        for _ in range(calls):
            client.completions.create(model="m", prompt=item.prompt, max_tokens=tokens)
        return 0.0

    limits = Limits(tokens, 10_000, 1.0, 1.0, 1, 600.0)
    host = AgentHost(Agent("bench", agent, False), Codec(engine.tokenizer, None), limits)

    def generate(prompts: list[list[int]], p: CallParams):
        return engine.generate_ids(prompts, SamplingParams(p.n, p.temperature, p.top_p,
                                                           p.max_tokens))  # fmt: skip

    try:
        started = time.perf_counter()
        runs = [host.start(Item(f"i{k}", PROMPT, ""), k) for k in range(batch)]
        host.serve(lambda: all(r.done for r in runs), generate)
        elapsed = time.perf_counter() - started
    finally:
        host.close()
    if any(r.outcome.failure for r in runs):
        raise RuntimeError(f"an agent failed: {[r.outcome.message for r in runs]}")
    return elapsed / (batch * calls)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: an untrained one)")
    p.add_argument("--batches", default="1,16", help="concurrent episodes, comma-separated")
    p.add_argument("--calls", type=int, default=20, help="calls per episode")
    p.add_argument("--max-new-tokens", type=int, default=4, help="tokens per call")
    p.add_argument("--repeats", type=int, default=3, help="best of this many")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(ROOT / "scripts"))
            from make_tiny_model import build_model, build_tokenizer

            tok = build_tokenizer()
            build_model(tok, 2, 128, 4, 0).save_pretrained(tmp)
            tok.save_pretrained(tmp)
            model = tmp
        engine = HFEngine(model)
        out: dict[str, dict[str, float]] = {"direct_ms": {}, "endpoint_ms": {}}
        for b in (int(x) for x in args.batches.split(",")):
            times: dict[str, list[float]] = {"direct_ms": [], "endpoint_ms": []}
            for _ in range(args.repeats + 1):  # the first of each is the warm-up
                times["direct_ms"].append(direct(engine, b, args.calls, args.max_new_tokens))
                times["endpoint_ms"].append(endpoint(engine, b, args.calls, args.max_new_tokens))
            for key, values in times.items():
                out[key][str(b)] = round(min(values[1:]) * 1e3, 3)
    ratio = {b: round(out["endpoint_ms"][b] / out["direct_ms"][b], 2) for b in out["direct_ms"]}
    overhead = {b: round(out["endpoint_ms"][b] - out["direct_ms"][b], 3) for b in out["direct_ms"]}
    print(json.dumps({"model": args.model or "untrained, demo shape", "calls": args.calls,
                      "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, **out,
                      "ratio": ratio, "overhead_ms": overhead}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
