"""A one-node Slurm cluster of the test's own: munged, slurmctld and slurmd as plain daemons
(Debian's slurm-wlm and munge; no systemd), on loopback ports, with everything in one
directory: proctrack/linuxproc, task/none, no accounting, the node's CPUs oversubscribed so that
a learner, generators and Redis fit as job steps on a 2-core machine. `SlurmCluster.env` is the
environment for sbatch, squeue and scancel (SLURM_CONF).

`gpus=N` declares N GPUs on the node (GresTypes=gpu, gres.conf with AutoDetect=off) backed by
character device files of the test's own (major 195, NVIDIA's, made with mknod): slurmd only
checks that they exist, and nothing opens them. Slurm then accepts `--gpus-per-node` and sets
SLURM_GPUS_PER_NODE and CUDA_VISIBLE_DEVICES in the job and its steps, as on a GPU cluster."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")


def unavailable() -> str | None:
    """Why no cluster can be started here, or None."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not installed (make test installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps as the submitting user"
    return None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, directory: Path, gpus: int = 0):
        self.dir = directory
        self.host = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        munge = directory / "munge"
        munge.mkdir(mode=0o700, parents=True)
        (directory / "state").mkdir()
        (directory / "spool").mkdir()
        self.socket = munge / "munge.sock"
        self.conf = directory / "slurm.conf"
        d = directory
        gres = self._fake_gpus(gpus)
        self.conf.write_text(
            f"""ClusterName=rollflash-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_port()}
SlurmdPort={_port()}
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
ReturnToService=2
{"GresTypes=gpu" if gpus else ""}
NodeName={self.host} NodeAddr=127.0.0.1 CPUs=16 RealMemory=8000 {gres}State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""
        )
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _fake_gpus(self, n: int) -> str:
        """The node's `Gres=` for n device files of its own (module docstring); "" for none."""
        if not n:
            return ""
        dev = self.dir / "dev"
        dev.mkdir()
        for i in range(n):
            os.mknod(dev / f"nvidia{i}", 0o600 | stat.S_IFCHR, os.makedev(195, i))
        files = f"{dev}/nvidia[0-{n - 1}]" if n > 1 else f"{dev}/nvidia0"
        (self.dir / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.host} Name=gpu File={files}\n"
        )
        return f"Gres=gpu:{n} "

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60)

    def start(self, timeout_s: float = 60) -> str | None:
        """Start the daemons; None once the node is idle, else why it did not come up."""
        munge = self.socket.parent
        self._run("mungekey", "-c", "-f", "-k", str(munge / "munge.key"))
        for args in (
            ["munged", "-F", "--force", "-S", str(self.socket), f"--key-file={munge}/munge.key",
             f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
             f"--seed-file={munge}/seed"],
            ["slurmctld", "-D", "-f", str(self.conf)],
            ["slurmd", "-D", "-f", str(self.conf)],
        ):  # fmt: skip
            log = open(self.dir / f"{args[0]}.out", "ab")
            self.procs.append(subprocess.Popen(args, env=self.env, stdout=log, stderr=log))
            log.close()
            time.sleep(0.3)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            state = self._run("sinfo", "-h", "-o", "%T").stdout.strip()
            if state == "idle":
                return None
            time.sleep(0.5)
        logs = [self.dir / n for n in ("slurmctld.log", "slurmd.log", "slurmd.out")]
        tail = " | ".join(p.read_text()[-300:] for p in logs if p.exists())
        return f"the one-node Slurm cluster did not come up in {timeout_s:.0f}s: {tail}"

    def sbatch(self, *args: str, env: dict[str, str]) -> str:
        out = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return out.stdout.strip().split(";")[0]

    def steps(self, job: str) -> dict[str, str]:
        """The job's running steps: name -> step id (JOB.STEP)."""
        out = self._run("squeue", "-h", "-s", "-j", job, "-o", "%i %j").stdout
        return {name: sid for sid, name in (line.split() for line in out.splitlines())}

    def running(self, job: str) -> bool:
        return bool(self._run("squeue", "-h", "-j", job, "-o", "%i").stdout.strip())

    def scancel(self, target: str) -> None:
        self._run("scancel", target)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
