"""What every `rollctl` command shares: the typer app, the common options, and how a command
loads its config and ends on an error (`guarded`).

Every expected failure (bad config, unreachable Redis, missing model: the project's own errors,
rollflash/errors.py) ends with one line on stderr naming the cause, and exit code 2; anything else
prints its traceback, and `rollctl --debug ...` prints the traceback of every error. The exit
codes (docs/running.md):

    0    done
    1    an error nobody foresaw (with its traceback)
    2    the project's own error: bad config, input or option, Redis unreachable, a missing file
    3    `rollctl run`: a failure every generator meets (a reward function, a missing engine)
    4    disk full: a write found no space (ENOSPC / EDQUOT); nothing is lost, free space and
         run the same command
    128 + N  stopped by signal N, cleanly: 130 after SIGINT (Ctrl-C), 143 after SIGTERM
"""

from __future__ import annotations

import errno
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

EXIT_ERROR = 2
EXIT_RUN_FATAL = 3  # `rollctl run`: a generator failed as every generator would (module docstring)
EXIT_DISK_FULL = 4
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT

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
    # transformers' and the hub's progress bars ("Loading weights") would fill the processes'
    # logs, which `rollctl run` echoes; set before either library is imported, here and in every
    # process a command starts
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def fail(message: str, code: int = 2) -> NoReturn:
    try:
        typer.echo(f"rollctl: error: {message}", err=True)
    except OSError:  # stderr on a full disk (a log in the run directory): the code still says it
        pass
    raise typer.Exit(code)


def load(config: Path | None, overrides: list[str] | None, redis_url: str | None):
    from rollflash.broker.config.config import ConfigError, load_config

    sets = list(overrides or [])
    if redis_url:
        sets.append(f"redis.url={redis_url}")
    try:
        return load_config(config, sets)
    except ConfigError as e:
        fail(str(e))


def guarded(fn, *args):
    """Run a command's function. The project's own errors (rollflash/errors.py) end the command
    with their one-line message, a full disk and a stop on a signal too, each with its exit code
    (module docstring); any other exception propagates with its traceback, and `--debug` prints
    the traceback of the project's errors too."""
    from rollflash.envs.reward_functions import RewardFunctionFailed
    from rollflash.errors import RollflashError, Stopped
    from rollflash.generators.engine import EngineUnavailable

    try:
        return fn(*args)
    except RollflashError as e:
        _debug_traceback()
        fatal = isinstance(e, (RewardFunctionFailed, EngineUnavailable))  # every generator's
        code = EXIT_RUN_FATAL if fatal else EXIT_ERROR
        fail(str(e).splitlines()[0] if str(e) else e.__class__.__name__, code)
    except Stopped as e:
        typer.echo(f"rollctl: {e}", err=True)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        typer.echo("rollctl: interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except BaseException as e:  # a torch.distributed.checkpoint failure is a BaseException
        where = disk_full(e)
        if where is None:
            raise
        _debug_traceback()
        fail(disk_full_line(where), EXIT_DISK_FULL)


def disk_full_line(where: str) -> str:
    """The one line of a full disk (`where`: the file, when the error names it)."""
    return (
        f"disk full: no space left on the device{f' writing {where}' if where else ''}; free "
        "space and run the same command (nothing is lost: the run resumes from its last "
        "checkpoint)"
    )


def _debug_traceback() -> None:
    if os.environ.get(DEBUG_ENV):
        try:
            traceback.print_exc()
        except OSError:
            pass


def disk_full(e: BaseException) -> str | None:
    """The file a write found no space for (ENOSPC or EDQUOT) anywhere in `e`'s chain ("" when
    no file is named), or None when `e` is not that. A torch.distributed.checkpoint failure holds
    its ranks' exceptions (`failures`); safetensors names the OS error only in its message."""
    todo: list[object] = [e]
    seen: set[int] = set()
    said = False  # a message names it, no OSError does
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return str(x.filename or "")
        said = said or "No space left on device" in str(x) or "StorageFull" in str(x)
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # rank -> (exception, stack)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return "" if said else None


def need_redis(cfg) -> None:
    if not cfg.redis.url:
        fail(
            "redis.url: not set; pass --redis-url or set it in the config "
            "(only `rollctl run` starts its own Redis)"
        )
