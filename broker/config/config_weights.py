"""The `weights:` section: how a weight version gets from the learner to the generators.

`transport: shared_fs` (the default): every host mounts `run.run_dir`, and a generator reads the
learner's store there. `transport: http`: the learner's publishing process serves its store over
HTTP (broker/weights/weight_server.py), each generator fetches a version into a store of its own and, with
`relay`, serves it on to other generators (broker/weights/weight_client.py); nothing but the network is
shared. Only `transport` is part of the run's fingerprint (broker/config/config.py): the other keys say
how one host runs (its address, files and certificates), so every host may use its own values.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from rollflash.broker.config.config_base import Number, Section
from rollflash.broker.config.config_errors import ConfigError
from rollflash.http_guard import ServerLimits


def split_listen(listen: str) -> tuple[str, int]:
    """`host:port` -> (host, port); raises ValueError naming the problem."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port (port 0: any free port), got {listen!r}")
    if host in ("0.0.0.0", "::", "[::]"):
        raise ValueError(f"{host} cannot be advertised to other hosts: name this host's address")
    return host.strip("[]"), int(port)


class WeightsConfig(Section):
    """`weights:`: the transport of weight versions (README "Weights across hosts")."""

    transport: Literal["shared_fs", "http"] = Field(
        "shared_fs",
        description="shared_fs: every host reads the learner's store in run.run_dir; http: "
        "generators fetch versions from the learner's publishing process over HTTP and "
        "relay them to each other",
    )
    listen: StrictStr = Field(
        "127.0.0.1:0",
        description="http: host:port this process serves versions on (the learner's "
        "publishing process, and each relaying generator); other hosts connect to this host, "
        "port 0 takes a free port",
    )
    token_file: StrictStr | None = Field(
        None,
        description="http: file whose first line is the token every request carries (else "
        "$ROLLFLASH_WEIGHTS_TOKEN; `rollctl run` makes one for its children)",
    )
    ssl_certfile: StrictStr | None = Field(
        None, description="http: serve over TLS with this certificate (PEM; with ssl_keyfile)"
    )
    ssl_keyfile: StrictStr | None = Field(None, description="http: the certificate's private key")
    ssl_ca_certs: StrictStr | None = Field(
        None,
        description="http: CA bundle that the servers' certificates must chain to (null: the "
        "ssl_ca_certs of redis.url if it names one, else the system's)",
    )
    relay: StrictBool = Field(
        True,
        description="http: a generator serves the versions it fetches to other generators, so "
        "the learner sends about one copy of each version",
    )
    fanout: StrictInt = Field(
        2,
        ge=1,
        description="http: generators one relay serves a version to; the learner serves a "
        "generator only when every relay is full",
    )
    local_dir: StrictStr | None = Field(
        None,
        description="a generator's own files, under {local_dir}/{generator id}: the versions "
        "it fetched over http, and the verified copy an engine that loads from a path reads "
        "(vllm, adapters); null: {run.run_dir}/local",
    )
    request_timeout_s: Number = Field(
        10.0,
        ge=2.0,
        description="http: a server closes a connection that has not sent a whole request's "
        "headers this long after it opened (or after its last answer), and refuses a body "
        "that takes longer (408)",
    )
    max_connections: StrictInt = Field(
        1024,
        ge=1,
        description="http: connections a server keeps open in all; more are reset at once "
        "(kept below the process's descriptor limit, ulimit -n)",
    )
    max_connections_per_peer: StrictInt = Field(
        256,
        ge=1,
        description="http: connections a server keeps open from one address (a generator "
        "opens at most 8 to one server); more are reset at once",
    )
    anchor_every: StrictInt = Field(
        10,
        ge=1,
        description="a version is published as a delta against the one before (its changed "
        "elements only), with a full anchor every this many versions, at the first version a "
        "publishing process writes, and whenever the delta would not be smaller; 1: every "
        "version full",
    )
    probe: StrictBool = Field(
        True,
        description="each generator proves the version it serves: the learner checks the "
        "log-probs of a fixed probe sequence that each generator's engine computes after a "
        "load against its own, and quarantines a generator whose probe differs "
        "(docs/ARCHITECTURE.md, 'Proof of serving')",
    )
    probe_tolerance: Number | None = Field(
        None,
        gt=0,
        description="mean |log-prob difference| over the probe allowed between a generator and "
        "the learner; null: 0.001 when the published weights and the engine are float32, 0.25 "
        "with bfloat16 or float16 on either side (broker/weights/probe.py)",
    )
    reload_attempts: StrictInt = Field(
        3,
        ge=1,
        description="times a generator tries a version it could not fetch, verify or load "
        "(with backoff) before it skips it",
    )

    @model_validator(mode="after")
    def _checked(self) -> WeightsConfig:
        try:
            split_listen(self.listen)
        except ValueError as e:
            raise ConfigError(f"weights.listen: {e}") from None
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ConfigError("weights.ssl_certfile: TLS needs both ssl_certfile and ssl_keyfile")
        return self


def server_limits(weights: WeightsConfig) -> ServerLimits:
    """What a weight server of this host accepts (rollflash/http_guard.py)."""
    return ServerLimits(
        request_timeout_s=float(weights.request_timeout_s),
        max_connections=weights.max_connections,
        max_connections_per_peer=weights.max_connections_per_peer,
    )
