"""What every `rollctl` command shares: the typer app, the common options, and how a command
loads its config and ends on an error (`guarded`).

Every expected failure (bad config, unreachable Redis, missing model: the project's own errors,
rollflash/errors.py) ends with one line on stderr naming the cause, and exit code 2; anything else
prints its traceback, and `rollctl --debug ...` prints the traceback of every error.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import NoReturn

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Asynchronous RL post-training: learner, generators, Redis streams.",
)

ConfigOpt = typer.Option(None, "--config", "-c", help="Run config YAML (see configs/).")
SetOpt = typer.Option(
    None, "--set", help="Override a config key, e.g. --set algo.clip_high=0.28 (repeatable)."
)
RedisOpt = typer.Option(
    None, "--redis-url", help="Redis URL (redis://, rediss://, unix://); overrides redis.url."
)


# set by `rollctl --debug`; the processes a command starts inherit it
DEBUG_ENV = "ROLLFLASH_DEBUG"

config_app = typer.Typer(
    no_args_is_help=True,
    help="The config reference: every key with its type, default and one-line doc.",
)
app.add_typer(config_app, name="config")


@app.callback()
def _options(
    debug: bool = typer.Option(
        False,
        "--debug",
        help="Print the traceback of every error, the project's own too (also in the processes "
        "a command starts: it sets ROLLFLASH_DEBUG=1).",
    ),
) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"


def fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"rollctl: error: {message}", err=True)
    raise typer.Exit(code)


def load(config: Path | None, overrides: list[str] | None, redis_url: str | None):
    from rollflash.broker.config import ConfigError, load_config

    sets = list(overrides or [])
    if redis_url:
        sets.append(f"redis.url={redis_url}")
    try:
        return load_config(config, sets)
    except ConfigError as e:
        fail(str(e))


def guarded(fn, *args):
    """Run a command's function. The project's own errors (rollflash/errors.py) end the command
    with their one-line message; any other exception propagates with its traceback, and
    `--debug` prints the traceback of the project's errors too."""
    from rollflash.envs.reward_functions import RewardFunctionFailed
    from rollflash.errors import RollflashError
    from rollflash.generators.engine import EngineUnavailable
    from rollflash.rollctl.local import EXIT_RUN_FATAL

    try:
        return fn(*args)
    except RollflashError as e:
        if os.environ.get(DEBUG_ENV):
            traceback.print_exc()
        fatal = isinstance(e, (RewardFunctionFailed, EngineUnavailable))  # every generator's
        code = EXIT_RUN_FATAL if fatal else 2
        fail(str(e).splitlines()[0] if str(e) else e.__class__.__name__, code)
    except KeyboardInterrupt:
        typer.echo("rollctl: interrupted", err=True)
        raise typer.Exit(130) from None


def need_redis(cfg) -> None:
    if not cfg.redis.url:
        fail(
            "redis.url: not set; pass --redis-url or set it in the config "
            "(only `rollctl run` starts its own Redis)"
        )
