"""The `weights:` section: how a weight version gets from the learner to the generators.

`transport: shared_fs` (the default): every host mounts `run.run_dir`, and a generator reads the
learner's store there. `transport: http`: the learner's publishing process serves its store over
HTTP (broker/weight_server.py), each generator fetches a version into a store of its own and, with
`relay`, serves it on to other generators (broker/weight_client.py); nothing but the network is
shared. Only `transport` is part of the run's fingerprint (broker/config.py): the other keys say
how one host runs (its address, files and certificates), so every host may use its own values.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from rollflash.broker.config_base import Section
from rollflash.broker.config_errors import ConfigError


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
