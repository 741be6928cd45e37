"""The commands a person runs beside a run, or after it: `status`, `inspect`, `redis-cli` and
`export`.

Each finds the run (rollctl/find.py): `--run-dir DIR`, `--run RUN_ID` (or a directory), nothing
(the newest run under ./runs), or `--config FILE` and `--redis-url` as every other command takes
them (`--redis-url` alone: the default config with `--set`'s keys, `run.run_id` among them);
then the run's Redis, which for a run `rollctl run` started and has stopped is the snapshot its
embedded server left.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import typer

from rollflash.rollctl.cli_base import ConfigOpt, RedisOpt, SetOpt, app, fail, guarded, load

RunDirOpt = typer.Option(
    None, "--run-dir", help="The run's directory (holds run.yaml), e.g. runs/demo."
)
RunOpt = typer.Option(
    None, "--run", help="A run id (or a run directory); default: the newest run under ./runs."
)


def run_config(
    run: str | None,
    run_dir: Path | None,
    config: Path | None,
    overrides: list[str] | None,
    redis_url: str | None,
):
    """The config of the run the options name: `--config` as given; the defaults with `--set`
    when only `--redis-url` says where the run is; else the run's own."""
    if config is not None or (redis_url and run is None and run_dir is None):
        return load(config, overrides, redis_url)
    from rollflash.rollctl.find import config_file, find_run_dir

    found = guarded(find_run_dir, run, run_dir)
    # the directory as found here: the saved run.run_dir may be relative to another directory
    return load(config_file(found), [*(overrides or []), f"run.run_dir={found}"], redis_url)


def _with_run_redis(cfg, show) -> None:
    from rollflash.rollctl.find import run_redis

    with run_redis(cfg) as url:
        cfg.redis.url = url
        show(cfg)


@app.command("status")
def status(
    run_arg: str | None = typer.Argument(
        None, metavar="[RUN]", help="A run id or directory (as --run)."
    ),
    run_dir: Path | None = RunDirOpt,
    run: str | None = RunOpt,
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    redis_url: str | None = RedisOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    watch: bool = typer.Option(
        False, "--watch", "-w", help="Redraw a compact view every --interval seconds."
    ),
    interval: float = typer.Option(2.0, "--interval", min=0.1, help="Seconds between redraws."),
) -> None:
    """Show queues, pending counts, the weight version and the generators (gone ones too)."""
    cfg = run_config(run_arg or run, run_dir, config, set_, redis_url)
    from rollflash.rollctl.status import show_status, watch_status

    if watch:
        guarded(_with_run_redis, cfg, lambda c: watch_status(c, interval))
    else:
        guarded(_with_run_redis, cfg, lambda c: show_status(c, as_json))


@app.command("inspect")
def inspect(
    entry_id: str | None = typer.Argument(
        None, metavar="[ENTRY-ID]", help="A stream entry id, e.g. 1718000000000-0."
    ),
    last: int | None = typer.Option(None, "--last", "-n", min=1, help="The last N entries."),
    stream: str = typer.Option(
        "trajectories", "--stream", "-s", help="prompts | trajectories (every generator's) | dlq"
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per entry and line."),
    run_dir: Path | None = RunDirOpt,
    run: str | None = RunOpt,
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    redis_url: str | None = RedisOpt,
) -> None:
    """Print stream entries decoded for a person: prompt and response text, rewards, versions,
    staleness, the dead-letter reason. Entries are decoded as the learner decodes them (bounded,
    validated): one it would refuse is shown as refused, with the reason."""
    if stream not in ("prompts", "trajectories", "dlq"):
        fail(f"--stream: one of prompts, trajectories, dlq, got {stream!r}")
    if (entry_id is None) == (last is None):
        fail("inspect: give an ENTRY-ID or --last N (one of the two)")
    cfg = run_config(run, run_dir, config, set_, redis_url)
    from rollflash.rollctl.inspect import show_entries

    which: Literal["prompts", "trajectories", "dlq"] = stream  # type: ignore[assignment]
    guarded(_with_run_redis, cfg, lambda c: show_entries(c, which, entry_id, last, as_json))


@app.command("export")
def export(
    run_dir: Path | None = RunDirOpt,
    run: str | None = typer.Option(None, "--run", help="A run id (or a run directory)."),
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    version: int | None = typer.Option(None, help="Weight version (default: latest)."),
    out: Path = typer.Option(..., "--out", help="Directory to write."),
    merge: bool = typer.Option(
        False, "--merge", help="LoRA adapter versions: write the merged model, not the adapter."
    ),
    best: bool = typer.Option(
        False, "--best", help="The version with the best held-out accuracy (eval.keep_best)."
    ),
) -> None:
    """Write a published weight version as a Hugging Face model (or PEFT adapter) directory.
    The run: --run-dir or --run (its own config, as for `rollctl status`), else --config (or the
    defaults) with --set."""
    named = run is not None or run_dir is not None
    cfg = run_config(run, run_dir, config, set_, None) if named else load(config, set_, None)
    if best and version is not None:
        fail("--best and --version name two versions; give one")
    from rollflash.learner.tools.export import export_version

    path = guarded(export_version, cfg, version, out, merge, best)
    typer.echo(f"exported to {path}")


@app.command(
    "redis-cli",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def redis_cli(
    ctx: typer.Context,
    run_dir: Path | None = RunDirOpt,
    run: str | None = RunOpt,
    config: Path | None = ConfigOpt,
    redis_url: str | None = RedisOpt,
) -> None:
    """redis-cli on the run's Redis: `rollctl redis-cli XINFO GROUPS rl:demo:traj:gen-0`
    (no command: an interactive session). The run's own embedded server, or the snapshot it left
    when stopped."""
    exe = shutil.which("redis-cli")
    if exe is None:
        fail("redis-cli not found on PATH; install it (apt-get install redis-tools)")
    cli = exe  # a name the closure sees as checked
    cfg = run_config(run, run_dir, config, None, redis_url)

    def call(c) -> None:
        argv, env = redis_cli_argv(c.redis.url or "")  # run_redis has found the address
        code = subprocess.run([cli, *argv, *ctx.args], env={**os.environ, **env}).returncode
        raise typer.Exit(code)

    guarded(_with_run_redis, cfg, call)


def redis_cli_argv(url: str) -> tuple[list[str], dict[str, str]]:
    """redis-cli's connection options for `url`, and its environment: the password travels in
    REDISCLI_AUTH, never on the command line."""
    from urllib.parse import parse_qs, unquote, urlsplit

    parts = urlsplit(url)
    env = {"REDISCLI_AUTH": unquote(parts.password)} if parts.password else {}
    user = ["--user", unquote(parts.username)] if parts.username else []
    if parts.scheme == "unix":
        db = parse_qs(parts.query).get("db", [])
        return ["-s", parts.path, *user, *(["-n", db[0]] if db else [])], env
    host = parts.hostname or "127.0.0.1"
    argv = ["-h", host, "-p", str(parts.port or 6379), *user]
    if parts.path.strip("/"):
        argv += ["-n", parts.path.strip("/")]
    if parts.scheme == "rediss":
        argv.append("--tls")
        ca = parse_qs(parts.query).get("ssl_ca_certs", [])
        argv += ["--cacert", ca[0]] if ca else []
    return argv, env
