"""The learner's check that each generator serves the version it reports (broker/weights/probe.py).

Rank 0 records the probe of every version it publishes (`record`, the newest `KEEP`), and at every
watch and every publish (`check`) reads, in one pipeline, the probe fields of every active
generator's status hash (written with the generator's own credentials, broker/connect/acl.py). A
report that is new (another version, or other values) is judged against the learner's probe of its
version; one that fails, or cannot be read, quarantines its generator (broker/channels/roster.py:
one log line with the reason, its entries refused, its prompts issued again; the run goes on with
the others). A report of a version the learner no longer remembers, or never probed (published
before this learner started), is not judged. A generator writes its probe as soon as it has computed
it, so its report of a version it skipped is judged within seconds, and at the latest when the
learner publishes the version after the next one: it serves wrong weights for at most one more
version. For the frozen rule each generator's earliest report with the values of its latest is kept,
so updates skipped one after the other add up to what the learner's probe moved since; a report also
carries the generator's report before it, so that a skip is caught at its first report even when the
learner never read the one before (it reported twice between two checks)."""

from __future__ import annotations

import logging
from collections import OrderedDict

from rollflash.broker.channels.roster import Roster
from rollflash.broker.connect.redis_io import RunRedis, text
from rollflash.broker.weights.probe import FIELDS, LearnerProbe, Report, parse_report, verdict

log = logging.getLogger(__name__)

KEEP = 64  # versions whose probe the learner remembers


class ServingCheck:
    """`io` and `roster`: rank 0's broker's (its lease fences the quarantines)."""

    def __init__(self, io: RunRedis, roster: Roster, tolerance: float | None):
        self.io, self.roster, self.tolerance = io, roster, tolerance
        self._probes: OrderedDict[int, LearnerProbe] = OrderedDict()
        self._last: dict[str, Report] = {}  # generator -> its last report judged
        self._same_since: dict[str, Report] = {}  # ... its earliest with the same values
        self.checked = 0  # reports judged

    def record(self, version: int, values: list[float], dtype: str) -> None:
        """The learner's probe of `version` (published weights of `dtype`)."""
        self._probes[version] = LearnerProbe(tuple(values), dtype)
        while len(self._probes) > KEEP:
            self._probes.popitem(last=False)

    def check(self) -> list[str]:
        """Judge every new report; returns the generators quarantined now."""
        if not self._probes:
            return []
        io, roster = self.io, self.roster
        active = roster.active()
        pipe = io.client.pipeline(transaction=False)
        for gid in active:
            pipe.hmget(io.keys.gen(gid), list(FIELDS))
        out = []
        for gid, raw in zip(active, pipe.execute()):
            fields = {k: text(v) for k, v in zip(FIELDS, raw) if v is not None}
            why = self._judge(gid, fields)
            if why is not None and roster.quarantine(gid, f"weights: {why}"):
                out.append(gid)
        for gone in set(self._last) - set(active) | set(out):  # memory: the active ones only
            self._last.pop(gone, None)
            self._same_since.pop(gone, None)
        return out

    def _judge(self, gid: str, fields: dict[str, str]) -> str | None:
        try:
            report = parse_report(fields)
        except ValueError as e:
            return f"an unreadable probe ({e})"
        if report is None or report == self._last.get(gid):
            return None
        learner = self._probes.get(report.version)
        if learner is None:
            return None
        since = self._same_since.get(gid)
        if since is None or since.values != report.values or since.version > report.version:
            since = self._same_since[gid] = report
            told = report.before  # the report before it, which the learner may not have read
            if told is not None and told.values == report.values:
                since = self._same_since[gid] = told
        old = self._probes.get(since.version)
        before = (since, old) if old is not None and since.version < report.version else None
        self._last[gid] = report
        self.checked += 1
        return verdict(report, learner, before, self.tolerance)
