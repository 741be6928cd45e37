"""Test certificates made with openssl: a CA and a server certificate it signed, for 127.0.0.1
(and any further IP addresses), in a directory: ca.pem, server.pem, server.key."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certs(d: Path, *ips: str) -> None:
    def ssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    ssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    )
    names = ",".join(f"IP:{ip}" for ip in ("127.0.0.1", *ips))
    (d / "ext.cnf").write_text(f"subjectAltName={names}\n")
    ssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
        "-out",
        "server.pem",
    )
