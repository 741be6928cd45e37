"""Weight sync of a ~1 GiB version to N generators, over each transport, against `cp` and `curl`.

A randomly initialised Qwen2 of about 1 GiB in float32 (hidden 1024, `--layers` 20, vocabulary
32000; speed and size only) is published once to a learner's weight store; a real redis-server
holds the run's `weights` hash, the learner's HTTP server (`weights.transport: http`) serves the
store as the publishing process does, and a zmq socket announces. For each transport and each N
in `--generators`, N generator processes run the production reload path (`WeightFollower` over
`version_source`: the streamed, verified read of the shared store, or the HTTP fetch into each
generator's own store with relays) with the sim engine, whose weights stay off the host as a
GPU engine's do; the version is announced, and each generator reports when it loaded it, its
fetch time, its pause and its peak RSS. In the same run, the bound: N parallel `cp` of the model
file into the generators' directories (shared_fs), or N parallel `curl` of it from the learner's
server (http). Ratios: `{transport}_{N}_vs_bound` = announce-to-all-loaded / the bound,
`http_{N}_egress` = bytes the learner served / the version's size.

The pause: one more process runs the hf engine on the same model (CPU), loads the version through
its `WeightFollower` (median of `--repeats`), then times a bare `model.load_state_dict` of the same
tensors already in memory (median of `--repeats`): `pause_vs_load_state_dict`.

Deltas (`--deltas qwen05b,demo`; scripts/delta_bench.py): consecutive versions of real training
runs published both as deltas and whole, in the same run: a version's delta bytes over its full
bytes, the share of elements changed, the publishing time each way, and the hf engine's pause
(and fetch) to load a version each way.

    python scripts/bench_weight_sync.py [--generators 1,2,4] [--layers 20] [--repeats 3]
        [--deltas qwen05b,demo] [--delta-steps 6] [--demo-steps 12]

Prints one JSON line (docs/BENCHMARKS.md, "Weight sync").
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

TOKEN = "bench-weight-sync"


def kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    raise KeyError(field)


def child(config: str, generator_id: str, version: int) -> None:
    """One generator's reload path: follow the `weights` hash until `version` is loaded, report,
    then keep relaying until the parent closes stdin."""
    from rollflash.broker.config.config import load_config
    from rollflash.broker.connect.connection import connect
    from rollflash.broker.sides.generator_side import GeneratorBroker
    from rollflash.generators.reload import WeightFollower, version_source
    from rollflash.generators.sim_engine import SimEngine

    cfg = load_config(config)
    broker = GeneratorBroker(connect(cfg.redis.url, 10), cfg.run.run_id, generator_id, 1_000_000)
    source = version_source(cfg, generator_id, broker)
    follower = WeightFollower(broker, source, SimEngine(cfg.sim, 0))
    time.sleep(1.0)  # the follower has read the hash and subscribed to the announcements
    print(json.dumps({"ready": True, "rss_kib": kib("VmRSS:")}), flush=True)
    while follower.loaded_version < version:
        follower.maybe_reload(wait_s=0.01)  # what the rollout loop does between batches
    loaded_at = time.time()
    print(
        json.dumps(
            {
                "loaded_at": loaded_at,
                "fetch_s": follower.reload_fetch_s,
                "pause_s": follower.reload_pause_s,
                "peak_rss_kib": kib("VmHWM:"),
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # serve the others until the parent is done
    follower.close()


def pause_child(model_dir: str, run_dir: str, sha: str, repeats: int) -> None:
    """The hf engine's swap against a bare load_state_dict of the same tensors, one process."""
    import torch

    from rollflash.broker.weights.weight_chain import verified_tensors
    from rollflash.broker.weights.weights import WeightStore
    from rollflash.generators.fetch import SharedStoreSource
    from rollflash.generators.hf_engine import HFEngine
    from rollflash.generators.reload import WeightFollower

    class Hash:
        def weights(self) -> dict[str, str]:
            return {"version": "1", "sha256": sha}

    torch.set_num_threads(2)
    engine, store = HFEngine(model_dir), WeightStore(run_dir)
    tensors = verified_tensors(store, 1, sha)
    # warm-up: the model's parameters come mmapped from its file; the first write into them
    # faults in every page, which a generator pays once, at its first reload
    engine.model.load_state_dict(tensors, strict=False)
    pauses, bare = [], []
    for i in range(repeats):  # alternately, so that other load on the machine hits both alike
        source = SharedStoreSource(store, Path(run_dir) / f"copies-{i}")
        follower = WeightFollower(Hash(), source, engine, poll_interval_s=0.01, attempts=1)
        follower.wait_for(1, timeout_s=600)
        pauses.append(follower.reload_pause_s)
        follower.close()
        started = time.perf_counter()
        engine.model.load_state_dict(tensors, strict=False)
        bare.append(time.perf_counter() - started)
    print(
        json.dumps(
            {
                "pause_s": statistics.median(pauses),
                "bare_s": statistics.median(bare),
                "peak_rss_kib": kib("VmHWM:"),
            }
        )
    )


def bound(transport: str, src: Path, url: str, dests: list[Path]) -> float:
    """Seconds for `len(dests)` parallel copies of the model file: cp from the store, or curl
    from the learner's server."""
    started = time.perf_counter()
    if transport == "shared_fs":
        cmds = [["cp", str(src), str(d)] for d in dests]
    else:
        auth = f"Authorization: Bearer {TOKEN}"
        cmds = [["curl", "-sf", "-H", auth, "-o", str(d), url] for d in dests]
    for p in [subprocess.Popen(c) for c in cmds]:
        assert p.wait() == 0
    elapsed = time.perf_counter() - started
    for d in dests:
        d.unlink()
    return elapsed


def sync_run(ctx: dict, transport: str, n: int) -> dict:
    """Announce a version to `n` fresh generators of a run of their own (its lease taken, its
    learner's server started); their times, pauses, RSS, and the learner's egress."""
    from rollflash.broker.config.config import load_config
    from rollflash.broker.connect.connection import connect
    from rollflash.broker.sides.learner_side import LearnerBroker
    from rollflash.learner.durability.publish_process import serve_store

    tmp, run_id = ctx["tmp"], f"sync-{transport}-{n}"
    version = ctx["next"] = ctx["next"] + 1  # a version of its own: a fresh plan of relays
    info = same_bytes(ctx["store"], ctx["info"], version)
    cfg = load_config(
        None,
        [
            f"run.run_id={run_id}",
            f"run.run_dir={tmp / 'learner'}",
            f"redis.url={ctx['redis_url']}",
            f"weights.transport={transport}",
            f"weights.local_dir={tmp / run_id}",
        ],
    )
    config = tmp / f"{run_id}.yaml"
    cfg.save(config)
    broker = LearnerBroker(connect(ctx["redis_url"], 10), run_id, 1_000_000)
    broker.take_lease()  # every write the learner makes is fenced by it (broker/channels/lease.py)
    server, zmq = serve_store(cfg, ctx["store"], broker), ctx["zmq"]
    try:
        broker.announce_weights(0, "", "", zmq.endpoint, server.url)  # v0: where to listen
        run = {"config": config, "broker": broker, "server": server, "local": tmp / run_id}
        return _sync(ctx, run, transport, n, version, info)
    finally:
        server.close()
        broker.release()


def _sync(ctx: dict, run: dict, transport: str, n: int, version: int, info) -> dict:
    broker, server, zmq = run["broker"], run["server"], ctx["zmq"]
    gens = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", str(run["config"]), f"g{i}", str(version)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    ready = [json.loads(g.stdout.readline()) for g in gens]
    broker.announce_weights(version, info.path, info.sha256, zmq.endpoint, server.url)
    zmq.announce(version, info.path, info.sha256)
    announced = float(broker._registry.weights()["published_at"])
    done = [json.loads(g.stdout.readline()) for g in gens]
    egress = server.served[version]
    for g in gens:
        g.stdin.close()
        g.wait(timeout=120)
    model = Path(info.path, "model.safetensors")
    dests = [run["local"] / f"bound-{i}" for i in range(n)]
    base = bound(transport, model, f"{server.url}/v/{version}/model.safetensors", dests)
    all_loaded = max(d["loaded_at"] for d in done) - announced
    return {
        "all_loaded_s": round(all_loaded, 2),
        "bound_s": round(base, 2),
        "vs_bound": round(all_loaded / base, 2),
        "fetch_s_max": round(max(d["fetch_s"] for d in done), 2),
        "pause_s_max": round(max(d["pause_s"] for d in done), 4),
        "peak_rss_gib_max": round(max(d["peak_rss_kib"] for d in done) / 2**20, 3),
        "start_rss_gib_max": round(max(r["rss_kib"] for r in ready) / 2**20, 3),
        "egress": round(egress / model.stat().st_size, 2),
    }


def same_bytes(store, info, version: int):
    """`info`'s version again as `version` (its model file hard-linked, a manifest of its own)."""
    import dataclasses

    d = store.version_dir(version)
    d.mkdir()
    os.link(Path(info.path, "model.safetensors"), d / "model.safetensors")
    manifest = json.loads(Path(info.path, "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**manifest, "version": version}))
    return dataclasses.replace(info, version=version, path=str(d))


def setup(tmp: Path, layers: int) -> dict:
    """The model, its version in the learner's store, Redis and zmq."""
    import torch
    from bench_publish_lora import build_model
    from transformers import AutoModelForCausalLM

    from rollflash.broker.connect.redis_server import EmbeddedRedis
    from rollflash.broker.weights.notify import VersionPublisher
    from rollflash.broker.weights.weights import WeightStore

    build_model(tmp / "model", 1024, layers, 32000)
    store = WeightStore(tmp / "learner")
    with torch.no_grad():
        info = store.publish(AutoModelForCausalLM.from_pretrained(tmp / "model").state_dict(), 1, 1)
    redis = EmbeddedRedis(tmp / "redis").start()
    return {
        "tmp": tmp,
        "store": store,
        "info": info,
        "next": 1,
        "redis": redis,
        "redis_url": redis.url,
        "zmq": VersionPublisher(),
    }


def measure(args: argparse.Namespace, tmp: Path) -> dict:
    os.environ["ROLLFLASH_WEIGHTS_TOKEN"] = TOKEN
    out = sync(args, tmp) if args.generators else {"bench": "weight_sync"}
    return out | deltas(args, tmp)


def deltas(args: argparse.Namespace, tmp: Path) -> dict:
    """The delta figures (scripts/delta_bench.py), each case in its own directory."""
    import delta_bench as d

    out: dict = {}
    cases = [c for c in args.deltas.split(",") if c]
    if "qwen05b" in cases:
        model = tmp / "qwen05b-model"
        d.qwen05b(model)
        versions = d.trained_versions(model, args.delta_steps, lr=1e-6)
        out |= d.measure("qwen05b", model, versions, tmp / "qwen05b", "bfloat16")
        shutil.rmtree(tmp / "qwen05b", ignore_errors=True)
    if "demo" in cases:
        import torch

        run = d.demo_run(tmp, args.demo_steps, Path(args.demo_model).resolve())
        for case, dtype in (("demo", torch.float32), ("demo_bf16", torch.bfloat16)):
            name = str(dtype).removeprefix("torch.")
            out |= d.measure(
                case, Path(args.demo_model), d.run_versions(run, dtype), tmp / case, name
            )
    return out


def sync(args: argparse.Namespace, tmp: Path) -> dict:
    ctx = setup(tmp, args.layers)
    size = Path(ctx["info"].path, "model.safetensors").stat().st_size
    out: dict = {
        "bench": "weight_sync",
        "version_gib": round(size / 2**30, 3),
        "cores": os.cpu_count(),
    }
    try:
        for transport in [t for t in args.transports.split(",") if t]:
            for n in (int(x) for x in args.generators.split(",")):
                for key, value in sync_run(ctx, transport, n).items():
                    out[f"{transport}_{n}_{key}"] = value
        pause = subprocess.run(
            [sys.executable, __file__, "--pause", str(tmp / "model"), str(tmp / "learner"),
             ctx["info"].sha256, str(args.repeats)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        p = json.loads(pause.stdout.splitlines()[-1])
        out |= {
            "hf_pause_s": round(p["pause_s"], 3),
            "hf_load_state_dict_s": round(p["bare_s"], 3),
            "pause_vs_load_state_dict": round(p["pause_s"] / p["bare_s"], 2),
            "hf_peak_rss_gib": round(p["peak_rss_kib"] / 2**20, 2),
        }
    finally:
        ctx["zmq"].close()
        ctx["redis"].stop()
    return out


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    if sys.argv[1:2] == ["--pause"]:
        return pause_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    if sys.argv[1:2] == ["--delta-pause"]:
        from delta_bench import pause_child as delta_pause

        return delta_pause(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generators", default="1,2,4", help="empty: no full-version sync")
    parser.add_argument("--transports", default="shared_fs,http")
    parser.add_argument("--layers", type=int, default=20, help="20: about 1 GiB in float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deltas", default="qwen05b,demo", help="cases of scripts/delta_bench.py")
    parser.add_argument("--delta-steps", type=int, default=6, help="AdamW steps of the 0.5B")
    parser.add_argument("--demo-steps", type=int, default=12)
    parser.add_argument("--demo-model", default="models/tiny", help="make demo builds it")
    parser.add_argument("--workdir", default=None, help="where the temp dir goes (a real disk)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-", dir=args.workdir) as tmp:
        print(json.dumps(measure(args, Path(tmp))))
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
