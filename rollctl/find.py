"""Finding a run and its Redis, for the commands a person runs beside a run or after it:
`rollctl status`, `rollctl inspect` and `rollctl redis-cli`.

A run is named by its directory (`--run-dir runs/demo`), by its run id (`--run demo`: the
directory `runs/demo`, or the run under ./runs whose config has that `run.run_id`), or by nothing:
then the run under ./runs whose config changed last. Its config is the `run.yaml` that
`rollctl run` writes there (or the `config.yaml` a learner writes), which holds the Redis URL
without its password (the password comes from the environment or `redis.password_file`, as for
any process of the run).

The run's Redis is that URL (or, in a config that sets none, the embedded server `rollctl run`
started for its run directory). When it is the embedded redis-server `rollctl run` started for the
run (it records the URL in `{run_dir}/redis/url`) and that server no longer answers, because the
run ended or was stopped, the snapshot it wrote at its clean stop (`{run_dir}/redis/dump.rdb`,
broker/connect/redis_server.py) is served by a private server while the command runs; nothing is written
back to it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from rollflash.broker.config.config import Config
from rollflash.broker.connect.connection import BrokerUnavailable
from rollflash.broker.connect.secrets import without_password
from rollflash.errors import MissingFile

RUNS = Path("runs")  # where `rollctl run`'s shipped configs put their runs
CONFIG_FILES = ("run.yaml", "config.yaml")  # written by `rollctl run`, by the learner
EMBEDDED_URL = Path("redis") / "url"  # under the run directory: the embedded server's URL


def config_file(run_dir: Path) -> Path | None:
    """The config a run directory holds (run.yaml, else config.yaml), or None."""
    return next((run_dir / n for n in CONFIG_FILES if (run_dir / n).is_file()), None)


def _run_id(path: Path) -> str | None:
    try:
        data = yaml.safe_load(path.read_text()) or {}
        return str(data.get("run", {}).get("run_id"))
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def find_run_dir(run: str | None, run_dir: Path | None) -> Path:
    """The directory of the run named by `run_dir`, by `run` (a run id or a directory) or, with
    neither, the newest run under ./runs; MissingFile (one line) when there is none."""
    if run_dir is None and run is not None:
        run_dir = Path(run) if config_file(Path(run)) else RUNS / run
        if config_file(run_dir) is None:  # a run id whose directory has another name
            named = [p.parent for p in _configs() if _run_id(p) == run]
            run_dir = named[0] if named else run_dir
    if run_dir is None:
        found = sorted(_configs(), key=lambda p: p.stat().st_mtime)
        if not found:
            raise MissingFile(
                f"no run under {RUNS}/ (no {' or '.join(CONFIG_FILES)}): name one with "
                "--run-dir DIR or --run RUN_ID, or --config FILE"
            )
        run_dir = found[-1].parent
    if config_file(run_dir) is None:
        raise MissingFile(
            f"{run_dir}: not a run directory (no {' or '.join(CONFIG_FILES)}; `rollctl run` "
            "and the learner write one into run.run_dir)"
        )
    return run_dir


def _configs() -> list[Path]:
    if not RUNS.is_dir():
        return []
    return [c for d in RUNS.iterdir() if d.is_dir() for c in [config_file(d)] if c is not None]


def record_embedded(run_dir: Path, url: str) -> None:
    """`rollctl run`: note that `url` is the run's own embedded server."""
    (run_dir / EMBEDDED_URL).write_text(url + "\n")


def is_embedded(run_dir: Path, url: str) -> bool:
    """Whether `url` is the embedded server `rollctl run` started for this run directory."""
    recorded = run_dir / EMBEDDED_URL
    return recorded.is_file() and recorded.read_text().strip() == without_password(url)


def answers(url: str) -> bool:
    """Whether a Redis answers at `url` at once (no retries)."""
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


@contextmanager
def run_redis(cfg: Config) -> Iterator[str]:
    """The URL to read the run's Redis at (module docstring), for as long as the block runs."""
    from rollflash.broker.connect.redis_server import snapshot_reader

    url, run_dir = cfg.redis.url, Path(cfg.run.run_dir)
    if not url and (run_dir / EMBEDDED_URL).is_file():  # a config that leaves it to `rollctl run`
        url = (run_dir / EMBEDDED_URL).read_text().strip()
    if not url:
        raise BrokerUnavailable(
            "redis.url: not set; name the run (--run-dir DIR, --run RUN_ID) or pass --redis-url"
        )
    if not is_embedded(run_dir, url) or answers(url):
        yield url
        return
    reader = snapshot_reader(run_dir / "redis")
    if reader is None:
        raise BrokerUnavailable(
            f"the run's embedded Redis ({url}) is not running and left no snapshot (it writes "
            f"{run_dir / 'redis' / 'dump.rdb'} when rollctl run stops cleanly)"
        )
    print(
        f"rollctl: the run's Redis is stopped; reading its snapshot {reader.dir / 'dump.rdb'} "
        "(changes are not kept)",
        file=sys.stderr,
    )
    with reader:
        yield reader.url
