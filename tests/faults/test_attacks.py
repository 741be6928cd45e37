"""The security review's attacks on a live run, each reproduced with real processes under
least-privilege ACL users on a real redis-server (tests/faults/attacks.py); attacks that do not
interfere share one live run (a run costs a minute of start-up and training). Each shows the
attack refused, or harmless to everything but the attacker's own work, with the learner still
running and nothing lost: every step completes, no trajectory is trained twice, and every entry
the learner acknowledged has exactly one ledger record.

An attacker is a redis-py client holding one generator's password: it can do exactly what that
generator's user may (broker/connect/acl.py), nothing the code of rollflash would refuse to send.
"""

import signal

import pytest
import redis
from attacks import AclRun, answer, partial, rss_bytes, steal_prompt
from harness import ledger_audit, ledgers, steps_done, stop_all, trained_ids, wait_until

STEPS, B = 6, 2
MAX_ID = "18446744073709551615-18446744073709551615"


@pytest.fixture
def run(tmp_path, redis_url, run_id):
    runs = []

    def make(steps=STEPS, gens=2, **sections):
        sections.setdefault("rollout", {}).setdefault("heartbeat_ttl_s", 600)
        r = AclRun(tmp_path, redis_url, run_id, steps, B, gens, **sections)
        runs.append(r)
        return r

    yield make
    for r in runs:
        r.close()


def _nothing_lost(r: AclRun, steps: int = STEPS, batch: int = B) -> None:
    trained = trained_ids(r.run_dir)
    assert len(trained) == len(set(trained)) == steps * batch  # every step complete, none twice
    # the attacked streams' own counters are what the attacker made them: left out
    quarantined = {g.decode() for g, v in r.admin.hgetall(r.keys.generators).items()
                   if v.startswith(b"quarantined")}  # fmt: skip
    audit = ledger_audit(r.admin, r.run_id, r.run_dir, skip=quarantined)
    assert audit["unrecorded"] == 0 and audit["multiple"] == [], audit


def test_one_learner_per_run_a_second_stops_and_one_that_lost_its_lease_stops_too(run):
    """A second learner stops at once naming the first and writes nothing. Then the first is
    stopped (a partition, a swap storm) past its lease's TTL (`redis.lease_ttl_s` 5 s): the next
    learner needs no --take-over, resumes, and the first, woken up, stops at its next write.
    The generators are held meanwhile, so the first learner is still waiting for a step (and
    renewing its lease) whenever the others start."""
    r = run(
        steps=12, redis={"lease_ttl_s": 5}, trainer={"checkpoint_every": 2, "wait_timeout_s": 300}
    )
    gens = [r.generator(f"gen-{i}") for i in range(2)]
    first = r.learner()
    try:
        wait_until(lambda: steps_done(r.run_dir) >= 2, 300, "two learner steps")  # start-up
        for g in gens:
            g.send_signal(signal.SIGSTOP)
        saved = (r.run_dir / "config.yaml").stat().st_mtime_ns
        second = r.learner()
        assert second.wait(timeout=120) == 2
        line = second.stderr_text().strip().splitlines()[-1]
        assert line.startswith(f"rollctl: error: run rl:{r.run_id}: has a learner already (host ")
        assert f", pid {first.pid}, since 20" in line and "--take-over" in line, line
        # it wrote nothing: no config, no resume (in the run hash or the ledger)
        assert (r.run_dir / "config.yaml").stat().st_mtime_ns == saved
        assert "resumed_from_step" not in r.run_hash()
        first.send_signal(signal.SIGSTOP)  # it stops renewing
        wait_until(lambda: not r.admin.exists(r.keys.lease), 60, "the lease to expire")
        third = r.learner()  # no --take-over: the lease lapsed
        wait_until(lambda: "resumed from" in third.stderr_text(), 120, "the third to resume")
        for g in gens:
            g.send_signal(signal.SIGCONT)
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=120) == 2
        assert "lost the lease of run" in first.stderr_text().strip().splitlines()[-1]
        assert third.wait(timeout=300) == 0, third.stderr_text()[-3000:]
    finally:
        for p in (first, *gens):
            p.send_signal(signal.SIGCONT)
        stop_all([first, *gens])
    (ledger,) = ledgers(r.run_dir)
    assert len([row for row in ledger if row.get("event") == "resume"]) == 1  # the third's
    _nothing_lost(r, 12)


def _nothing_of_others(evil: redis.Redis, k) -> None:
    """A generator's credentials reach no other generator's keys, nor the learner's."""
    for attempt in (
        lambda: evil.xadd(k.trajectories("gen-2"), {"x": 1}),
        lambda: evil.xadd(k.dlq, {"code": "corrupt"}),
        lambda: evil.xadd(k.prompts, {"x": 1}),
        lambda: evil.hset(k.gen("gen-2"), "dead_letters", 1_000_000),
        lambda: evil.hincrby(k.dlq_reasons, "corrupt", 1_000_000),
        lambda: evil.hset(k.generators, "gen-2", "quarantined spoofed"),
        lambda: evil.hset(k.run, "quarantined", 0),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()


def test_xadd_attacks_spoofing_and_a_flood_harm_only_the_attackers_own_work(run):
    """`XADD <stream> NOMKSTREAM 2^64-1-2^64-1 x y` makes every later XADD to the stream fail
    (gen-0 does it to its streams); `XADD <stream> NOMKSTREAM MAXLEN 0 * x y` empties it (gen-1).
    Their passwords reach only their own streams, heartbeats and nothing of the learner's: both
    are quarantined, their prompts are issued again, and gen-2 trains the run. Then gen-3, no
    generator process but its credentials, joins and floods its stream with 40 one-sample
    entries of about 0.7 MB each (28 MB) of groups never issued, claiming the newest possible
    version: refused, and neither the learner nor Redis keeps them."""
    r = run(steps=16, gens=4, trainer={"wait_timeout_s": 300})  # steps left for gen-2 alone
    gens = [r.generator(f"gen-{i}") for i in range(3)]
    learner = r.learner()
    k = r.keys
    try:
        wait_until(lambda: steps_done(r.run_dir) >= 1, 300, "a learner step")  # start-up
        gens[2].send_signal(signal.SIGSTOP)  # the learner waits for it through the attacks
        for gid in ("gen-0", "gen-1"):
            evil = r.attacker(gid)
            _nothing_of_others(evil, k)
            # what it says of itself is allowed, and shown as its own
            evil.hset(k.gen(gid), "dead_letters", 1_000_000)
            for stream in (k.trajectories(gid), k.generator_dlq(gid)):
                if gid == "gen-0":
                    evil.execute_command("XADD", stream, "NOMKSTREAM", MAX_ID, "x", "y")
                else:
                    evil.execute_command("XADD", stream, "NOMKSTREAM", "MAXLEN", "0", "*", "x", "y")
        wait_until(
            lambda: r.generator_status("gen-0") != "active" != r.generator_status("gen-1"),
            60,
            "both quarantines",
        )
        status = r.status()
        flood = _flood(r, learner.pid)
        gens[2].send_signal(signal.SIGCONT)
        assert learner.wait(timeout=180) == 0, learner.stderr_text()[-3000:]
        assert gens[2].wait(timeout=60) == 0, gens[2].stderr_text()[-3000:]
        for g in gens[:2]:
            assert g.wait(timeout=60) == 2  # each stops with one line naming why
    finally:
        gens[2].send_signal(signal.SIGCONT)
        stop_all([learner, *gens])
    assert "generator gen-0 QUARANTINED: stream bricked" in status, status
    assert "generator gen-1 QUARANTINED: stream trimmed" in status, status
    # the learner's own count (a pending entry gen-1 deleted is one): no generator can raise it
    line = next(x for x in status.splitlines() if x.startswith("dead letters:"))
    assert int(line.split()[2]) < 10, line
    assert r.generator_status("gen-2") == "active" and r.run_hash()["quarantined"] == "3"
    assert r.admin.hget(k.gen("gen-2"), "dead_letters") == b"0"
    # the flood is 40 x 60,000 tokens x 12 bytes = 28.8 MB; what the learner may hold of it is
    # one read's worth, and it has let go of that by now
    rss, used = flood
    assert rss[1] - rss[0] < 16 * 2**20, rss
    # Redis keeps 10 of them (7.2 MB), and of each dead letter 64 KiB per field
    assert used[1] - used[0] < 12 * 2**20, used
    assert r.admin.xlen(r.keys.dlq) <= 40 + 10  # the flood's, and the first attacks' (above)
    _nothing_lost(r, 16)


def _join(r: AclRun, gid: str) -> redis.Redis:
    """Generator `gid`'s credentials, admitted to the run with no generator process."""
    evil = r.attacker(gid)
    evil.hset(r.keys.gen(gid), "state", "up")  # its heartbeat and its request to join
    evil.sadd(r.keys.joined, gid)
    wait_until(lambda: r.generator_status(gid) == "active", 60, f"{gid}'s admission")
    return evil


def _flood(r: AclRun, pid: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """gen-3 joins and floods its stream (see above) until it is quarantined and its stream
    kept at 10 entries (broker/channels/roster.py `contain`): the learner's RSS and Redis's used_memory
    before and after."""
    evil, stream = _join(r, "gen-3"), r.keys.trajectories("gen-3")
    rss, used = [rss_bytes(pid)], [r.admin.info("memory")["used_memory"]]
    for k in range(40):
        evil.xadd(stream, partial("gen-3", k))
    wait_until(lambda: r.generator_status("gen-3") != "active", 60, "gen-3's quarantine")
    wait_until(lambda: r.admin.xlen(stream) <= 10, 60, "the flood's trim")
    rss.append(rss_bytes(pid))
    used.append(r.admin.info("memory")["used_memory"])
    return (rss[0], rss[1]), (used[0], used[1])


def test_publish_and_ack_are_one_call_so_a_kill_never_loses_a_prompt(run):
    """gen-0 is killed (SIGKILL) three times and started again: a prompt is acknowledged only
    by the call that stores its trajectory, so no prompt is ever acknowledged without one and
    the learner never has to issue one again (run hash `reissued`)."""
    r = run(steps=10, sim={"per_token_s": 0.004})
    survivor = r.generator("gen-1")
    victim = r.generator("gen-0")
    learner = r.learner()
    try:
        for kill in range(3):
            at = 2 + 2 * kill
            wait_until(lambda at=at: steps_done(r.run_dir) >= at, 120, "learner progress")
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            victim = r.generator("gen-0")  # the same id: it re-reads its own pending prompts
        assert learner.wait(timeout=300) == 0, learner.stderr_text()[-3000:]
    finally:
        stop_all([learner, survivor, victim])
    assert int(r.run_hash().get("reissued", 0)) == 0
    _nothing_lost(r, 10)


def _forge(r: AclRun, gid: str, forgery: str) -> None:
    """As generator `gid` (its own password): join, claim a prompt, answer it with a forgery,
    and drop the prompt, as a thief would."""
    evil, k = _join(r, gid), r.keys
    entry_id, fields = steal_prompt(evil, k, gid)
    if forgery == "future":
        forged = answer(fields, gid, version=2**31 - 1)
    elif forgery == "never issued":
        forged = answer(fields, gid, group_id="g999999999", traj_id="g999999999")
    else:
        forged = answer(fields, gid, text="z" * 100_000)
    evil.xadd(k.trajectories(gid), forged)
    evil.xack(k.prompts, "gen", entry_id)


def test_forged_entries_are_dead_lettered_and_nothing_is_lost(run):
    """With their own passwords, gen-0, gen-1 and gen-2 each claim one of the first step's
    prompts before any generator runs and answer it themselves: gen-0 with weights of version
    2^31 - 1 (newer than the learner's), gen-1 for a group the learner never issued (its MAC
    cannot match), gen-2 with a 100 kB text; each then drops the prompt. Each entry goes to the
    dlq with its reason; the first two are forgeries, so their generators are quarantined. With
    async_ratio 0 a step needs every prompt it issued: the learner finishes only because it
    issues the three dropped ones again (broker/channels/inflight.py)."""
    r = run(gens=4, trainer={"async_ratio": 0, "rollout_batch_size": 3})
    learner = r.learner()
    gens = []
    try:
        for gid, forgery in (("gen-0", "future"), ("gen-1", "never issued"), ("gen-2", "text")):
            _forge(r, gid, forgery)
        gens = [r.generator(f"gen-{i}") for i in range(4)]
        assert learner.wait(timeout=300) == 0, learner.stderr_text()[-3000:]
    finally:
        stop_all([learner, *gens])
    dead = {f[b"source"].decode().rsplit(":", 1)[1]: f for _, f in r.admin.xrange(r.keys.dlq)}
    codes = {gid: f[b"code"].decode() for gid, f in dead.items()}
    assert codes == {"gen-0": "future_version", "gen-1": "not_issued", "gen-2": "too_large"}
    assert [r.generator_status(f"gen-{i}") == "active" for i in range(4)] == [
        False, False, True, True,  # a long text is no forgery
    ]  # fmt: skip
    assert int(r.run_hash()["reissued"]) >= 3  # the three dropped prompts came back
    _nothing_lost(r, batch=3)


def test_a_generator_that_answers_with_other_prompt_tokens_is_quarantined_and_none_trained(run):
    """gen-0's password claims all three prompts of the first step (async_ratio 0) before any
    generator runs and answers each with 40 copies of one token as its prompt, under the
    prompt's genuine MAC (copied, as an honest generator does), in one transaction, then
    acknowledges the prompts. The learner derived and signed the prompt tokens it issued
    (broker/channels/provenance.py), so all three are dead-lettered as `wrong_prompt` (their fields'
    tag matched: not `not_issued`), gen-0 is quarantined, none of its entries is trained, and
    the three prompts are issued again and trained from gen-1 and gen-2, whose own prompt
    tokens pass."""
    r = run(gens=3, trainer={"async_ratio": 0, "rollout_batch_size": 3})
    learner = r.learner()
    gens = []
    try:
        evil, k = _join(r, "gen-0"), r.keys
        stolen = [steal_prompt(evil, k, "gen-0") for _ in range(3)]
        with evil.pipeline(transaction=True) as tx:
            for _, fields in stolen:
                tx.xadd(k.trajectories("gen-0"), answer(fields, "gen-0", prompt=[7] * 40))
            tx.xack(k.prompts, "gen", *[entry_id for entry_id, _ in stolen])
            tx.execute()
        gens = [r.generator(f"gen-{i}") for i in (1, 2)]
        assert learner.wait(timeout=300) == 0, learner.stderr_text()[-3000:]
    finally:
        stop_all([learner, *gens])
    groups = {f[b"group_id"].decode() for _, f in stolen}
    dead = [f for _, f in r.admin.xrange(r.keys.dlq)]
    assert sorted(f[b"orig_group_id"].decode() for f in dead) == sorted(groups)
    assert {f[b"code"].decode() for f in dead} == {"wrong_prompt"}
    assert all(f[b"source"].decode().endswith(":traj:gen-0") for f in dead)
    assert (r.generator_status("gen-0") or "").startswith("quarantined wrong_prompt")
    assert [r.generator_status(g) for g in ("gen-1", "gen-2")] == ["active", "active"]
    rows = [row for row in ledgers(r.run_dir)[0] if row.get("event") is None]
    trained_refs = [ref for row in rows for ref in row["refs"]]
    assert not [ref for ref in trained_refs if ref.startswith("gen-0/")]  # 0 forged trained
    assert groups <= set(trained_ids(r.run_dir))  # issued again, answered honestly, trained
    assert int(r.run_hash()["reissued"]) >= 3
    _nothing_lost(r, batch=3)
