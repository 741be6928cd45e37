"""The Redis password: where it may come from, and where it must never go.

A password may be written in `redis.url` (`redis://user:pw@host:6379`), kept in a file named by
`redis.password_file` (its first line), or passed in the environment variable
`ROLLFLASH_REDIS_PASSWORD`; the first of these that is set wins, and a URL with a password plus a
password file is refused as ambiguous. `load_config` puts the password into the in-memory URL, so
every process connects the same way.

It never reaches the disk or a log: `Config.save` writes the URL without its password into a file
of mode 0600 (in a run directory of mode 0700 when rollflash makes it), and every message shows
the URL through `redact`. Directories: rollflash makes the ones it creates 0700 and never changes
the mode of one it did not create; the run's private files (weights, checkpoints, Redis's data,
logs) are in directories it creates. `rollctl run` hands the password to its
children in `ROLLFLASH_REDIS_PASSWORD`, since the config file it gives them holds none.

The weights' HTTP transport (`weights.transport: http`) has a token of its own, which every
request to the learner's or a relay's server carries: the first line of `weights.token_file`,
else `ROLLFLASH_WEIGHTS_TOKEN` (`rollctl run` makes a random one for its children). It is never
saved either, and never part of the config.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit

from rollflash.errors import BadInput

PASSWORD_ENV = "ROLLFLASH_REDIS_PASSWORD"
TOKEN_ENV = "ROLLFLASH_WEIGHTS_TOKEN"


def _with_netloc_password(url: str, password: str | None) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    if password is None:
        netloc = f"{user}@{host}" if user else host
    else:
        netloc = f"{user}:{password}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def redact(url: str) -> str:
    """The URL with its password replaced by ***, for messages and logs. Works on text, not a
    parse, so that a URL too malformed to parse (a '/' in an unencoded password) is masked too:
    whatever lies between `user:` and the last '@' is the password."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in creds:
        return url
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"


def without_password(url: str) -> str:
    """The URL with no password at all (the user, host and options stay): what is saved."""
    return url if urlsplit(url).password is None else _with_netloc_password(url, None)


def url_password(url: str) -> str | None:
    """The password written in the URL, decoded, or None."""
    password = urlsplit(url).password
    return None if password is None else unquote(password)


def with_password(url: str, password: str) -> str:
    """The URL carrying `password` (percent-encoded)."""
    return _with_netloc_password(url, quote(password, safe=""))


def read_password_file(path: str) -> str:
    """The first line of `path`; raises OSError or ValueError with the cause."""
    text = Path(path).read_text()
    password = text.splitlines()[0].strip() if text.strip() else ""
    if not password:
        raise ValueError("the file is empty")
    return password


def weights_token(token_file: str | None) -> str:
    """The weights transport's token: the first line of `token_file`, else $ROLLFLASH_WEIGHTS_TOKEN;
    ValueError with the fix when there is none."""
    if token_file is not None:
        try:
            return read_password_file(token_file)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"weights.token_file: cannot read a token from {token_file} ({e})"
            ) from None
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(
            f"weights.token_file: weights.transport http needs an access token: name a file "
            f"holding one in weights.token_file, or set ${TOKEN_ENV}"
        )
    return token


def url_ca_certs(url: str | None) -> str | None:
    """The `ssl_ca_certs` option of a rediss:// URL (the CA its TLS trusts), or None."""
    if not url:
        return None
    found = parse_qs(urlsplit(url).query).get("ssl_ca_certs")
    return found[0] if found else None


def env_password() -> str | None:
    return os.environ.get(PASSWORD_ENV) or None


def make_private_dir(path: Path) -> Path:
    """Create `path`, and each missing directory above it, readable by its owner only (0700). A
    directory that exists keeps its mode: rollflash never changes the mode of a directory it did
    not create (`run.run_dir` may name /tmp). Returns `path`."""
    missing, up = [], path
    while not up.is_dir() and up.parent != up:
        missing.append(up)
        up = up.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)  # FileExistsError if it is a file
    return path


def private_subdir(path: Path) -> Path:
    """`path`, a directory only this process's user writes (checkpoints, Redis's data, logs, a
    generator's own store), made by `make_private_dir`. One that exists must be this user's and
    writable by nobody else: in a shared run directory it could be someone else's. Returns
    `path`."""
    make_private_dir(path)
    st = path.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise BadInput(
            f"{path}: holds the run's private files but is owned by uid {st.st_uid} with mode "
            f"{st.st_mode & 0o7777:04o}, which others can write or own; remove it, or choose "
            "another run.run_dir"
        )
    return path


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600, even if the file existed with wider bits."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)
