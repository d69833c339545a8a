"""`gpuctl apply` and the recovery of an interrupted one, without a daemon: the Rebalancer and
Recovery over the rig of tests/rig.py (a real service and store, simulated observation, a fake
unit manager) and a real config file in a tmp dir. Each refusal, each step, each failure and
the rollback it leads to."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpud.config import parse_config
from gpud.core.vocab import RUNNING
from gpud.errors import ConfigError, Conflict, Denied, GpudError, JobFailed
from gpud.life.rebalance import JOURNAL, Rebalancer, Recovery, backup
from tests.rig import Rig, entered, make_rig

CONFIG = """
[daemon]
admission = "ledger"
state_dir = "{tmp}"
health_interval_s = {health}
memory_return_timeout_s = 0
backups_keep = 2

[roles.r]
device = "GPU-sim-0"
capacity_mib = 1000

[serves.a]
role = "r"
vram_mib = 300
resident = true
priority = 10
command = ["/bin/true", "a"]

[serves.b]
role = "r"
vram_mib = 200
resident = true
priority = 20
command = ["/bin/true", "b"]

[serves.c]
role = "r"
vram_mib = 100
command = ["/bin/true", "c"]
"""


@dataclass
class Apply:
    rig: Rig
    path: Path
    old: str
    rebalancer: Rebalancer
    steps: list[dict[str, Any]] = field(default_factory=list)
    reloads: list[str] = field(default_factory=list)
    fail_reload_at: set[int] = field(default_factory=set)
    on_step: dict[str, Any] = field(default_factory=dict)

    async def reload(self, uid: int | None, text: str) -> dict[str, Any]:
        """What the daemon's reload does with the text apply has just written."""
        self.reloads.append(text)
        if len(self.reloads) in self.fail_reload_at:
            raise Conflict("reload refused for the test")
        cfg = parse_config(text, str(self.path))
        over = await self.rig.svc.reload(cfg, text, source=str(self.path), uid=uid)
        return {"reloaded": True, "over_committed": over}

    async def emit(self, step: dict[str, Any]) -> None:
        self.steps.append(step)
        hook = self.on_step.get(step["step"])
        if hook is not None:
            hook()

    def names(self) -> list[str]:
        return [s["step"] for s in self.steps]

    async def run(self, text: str, uid: int | None = 1) -> dict[str, Any]:
        return await self.rebalancer.apply(text, "new.toml", uid, self.emit)


@pytest.fixture
async def ap(tmp_path: Path) -> AsyncIterator[Apply]:
    r = await make_rig(tmp_path, CONFIG)
    path = tmp_path / "serves.toml"
    old = r.svc.config_text or ""
    path.write_text(old)
    path.chmod(0o600)
    holder: list[Apply] = []

    async def reload(uid: int | None, text: str) -> dict[str, Any]:
        return await holder[0].reload(uid, text)

    rb = Rebalancer(r.svc, r.sup, r.observer, config_path=path, reload=reload)
    a = Apply(r, path, old, rb)
    holder.append(a)
    async for _ in entered(r):
        await r.sup.boot_job.boot()
        assert r.state("a") == RUNNING and r.state("b") == RUNNING
        yield a


def resized(text: str) -> str:
    """a 300 -> 350 (a restart), b 200 -> 150 (a restart, shrinking: goes first), d added as a
    resident (a start), c removed (released at the reload)."""
    text = text.replace("vram_mib = 300", "vram_mib = 350").replace("vram_mib = 200",
                                                                    "vram_mib = 150")
    text = text.split("[serves.c]")[0]
    return text + '\n[serves.d]\nrole = "r"\nvram_mib = 100\nresident = true\npriority = 30\n' \
                  'command = ["/bin/true", "d"]\n'


# ---- refusals before anything is touched -----------------------------------------------------


async def test_an_apply_needs_a_config_file(ap: Apply) -> None:
    rb = Rebalancer(ap.rig.svc, ap.rig.sup, ap.rig.observer, config_path=None,
                    reload=ap.reload)
    with pytest.raises(Conflict, match="gpud runs without a config file"):
        await rb.apply(ap.old, "x", None, ap.emit)


async def test_an_apply_waits_for_the_resident_set(tmp_path: Path) -> None:
    r = await make_rig(tmp_path, CONFIG)
    async for _ in entered(r):
        await r.svc.admit("a", 300)
        rb = Rebalancer(r.svc, r.sup, r.observer, config_path=tmp_path / "x.toml",
                        reload=lambda *_a: None)  # type: ignore[arg-type, return-value]
        with pytest.raises(Conflict, match=r"still starting: apply when it is done "
                                           r"\(starting: a\)") as err:
            rb.check_can_begin()
        assert err.value.details == {"starting": ["a"]}
        await r.svc.release("a")
        with pytest.raises(Conflict, match=r"\(starting: none yet\)"):
            rb.check_can_begin()


async def test_one_apply_at_a_time(ap: Apply) -> None:
    seen: list[str] = []

    def second() -> None:
        assert ap.rebalancer.busy
        try:
            ap.rebalancer.check_can_begin()
        except Conflict as exc:
            seen.append(exc.message)

    ap.on_step["backup"] = second
    result = await ap.run(resized(ap.old))
    assert result["result"] == "applied"
    assert seen == ["another apply is in progress"]
    assert not ap.rebalancer.busy


async def test_a_change_the_ledger_cannot_follow_is_refused_whole(ap: Apply) -> None:
    await ap.rig.svc.admit("ext", 50, role="r")
    text = ap.old + '\n[serves.ext]\nrole = "r"\nvram_mib = 50\ncommand = ["/bin/true"]\n'
    with pytest.raises(Conflict, match="apply refused, nothing changed: ext") as err:
        await ap.run(text)
    assert err.value.details["blockers"][0]["what"] == "ext"
    assert ap.steps == [{"step": "validate", "ok": False,
                         "message": "refused: " + err.value.details["blockers"][0]["message"]}]
    assert ap.path.read_text() == ap.old
    assert ap.rig.svc.store.meta(JOURNAL) is None
    assert not (ap.path.parent / "backups").exists()
    [ev] = ap.rig.events(kinds=["apply"])
    assert ev.details == {"step": "validate", "ok": False} and ev.uid == 1


async def test_a_resident_set_that_does_not_fit_is_refused(ap: Apply) -> None:
    text = ap.old.replace("vram_mib = 100", "vram_mib = 600\nresident = true")
    with pytest.raises(Denied, match="apply refused, nothing changed: the resident set does "
                                     "not fit: ") as err:
        await ap.run(text)
    assert err.value.details["plan"]["denied"]
    assert ap.names() == ["validate"] and ap.steps[0]["ok"] is False
    assert ap.path.read_text() == ap.old


async def test_a_plan_of_a_bad_file_names_the_problem(ap: Apply) -> None:
    with pytest.raises(ConfigError):
        ap.rebalancer.plan("[roles.r\n", "bad.toml")
    plan = ap.rebalancer.plan(resized(ap.old), "new.toml")
    assert plan.ok and sorted(plan.restart) == ["a", "b"]


# ---- a whole apply --------------------------------------------------------------------------


async def test_apply_restarts_shrinking_before_growing_then_starts(ap: Apply) -> None:
    r = ap.rig
    new = resized(ap.old)
    result = await ap.run(new, uid=4)
    assert result["result"] == "applied"
    assert ap.names() == ["validate", "backup", "write", "reload", "restart", "restart",
                          "start", "verify"]
    assert [s.get("serve") for s in ap.steps if s["step"] in ("restart", "start")] == [
        "b", "a", "d"]  # b shrinks (frees memory), then a grows, then the new resident
    assert all(s["ok"] for s in ap.steps)
    assert ap.path.read_text() == new
    assert Path(result["backup"]).read_text() == ap.old
    assert r.svc.store.meta(JOURNAL) is None
    assert r.held() == {"a": 350, "b": 150, "d": 100}
    assert {n: r.state(n) for n in ("a", "b", "d")} == {"a": RUNNING, "b": RUNNING, "d": RUNNING}
    assert set(r.svc.config.serves) == {"a", "b", "d"}
    assert result["summary"] == r.svc.summary()
    assert {e.uid for e in r.events(kinds=["apply"])} == {4}


async def test_an_apply_that_changes_nothing_writes_no_backup(ap: Apply) -> None:
    """Ten no-op applies used to write ten backups, pushing every earlier one out."""
    first = await ap.run(resized(ap.old))
    assert first["result"] == "applied" and first["backup"] is not None
    kept = sorted((ap.path.parent / "backups").iterdir())
    before = ap.path.stat().st_mtime_ns
    for _ in range(3):
        ap.steps.clear()
        result = await ap.run(resized(ap.old))
        assert result["result"] == "applied" and result["backup"] is None, result
        assert "backup" not in ap.names() and "write" not in ap.names(), ap.names()
    assert sorted((ap.path.parent / "backups").iterdir()) == kept
    assert ap.path.stat().st_mtime_ns == before  # not written again either
    # a change writes a backup again, of what was there
    ap.steps.clear()
    changed = await ap.run(ap.old)
    assert "backup" in ap.names() and Path(changed["backup"]).read_text() == resized(ap.old)


async def test_backups_keep_prunes_the_backups_of_applies(ap: Apply) -> None:
    assert ap.rig.svc.config.daemon.backups_keep == 2
    texts = [resized(ap.old), ap.old, resized(ap.old)]
    saved = [(await ap.run(text))["backup"] for text in texts]
    assert sorted(str(p) for p in (ap.path.parent / "backups").iterdir()) == sorted(saved[1:])


async def test_a_live_serve_that_leaves_is_stopped_first(ap: Apply) -> None:
    r = ap.rig
    await r.sup.launch_job.start("c", None, wait=True)
    new = ap.old.split("[serves.c]")[0]
    result = await ap.run(new)
    assert result["result"] == "applied"
    assert ap.names() == ["validate", "backup", "stop", "write", "reload", "verify"]
    assert "stop first: c" in ap.steps[0]["message"]
    assert "c" in r.units.stopped
    assert r.held() == {"a": 300, "b": 200}


async def test_an_apply_leaves_a_serve_that_is_only_admitted_as_it_is(ap: Apply) -> None:
    """c is not resident and holds an admission (gpuctl admit): an apply that does not change
    it does not start it; one that moves it to another role releases its admission and starts
    nothing, as its plan says."""
    r = ap.rig
    await r.svc.admit("c", 100)
    new = resized(ap.old).split("[serves.d]")[0]  # a and b restart; c stays as it is
    new += '\n[serves.c]\nrole = "r"\nvram_mib = 100\ncommand = ["/bin/true", "c"]\n'
    result = await ap.run(new)
    assert result["result"] == "applied"
    assert [s.get("serve") for s in ap.steps if s["step"] in ("restart", "start")] == ["b", "a"]
    assert "c" not in [u.serve for u in r.units.started]
    assert r.state("c") == "admitted" and r.held() == {"a": 350, "b": 150, "c": 100}

    ap.steps.clear()
    moved = new.replace('[serves.c]\nrole = "r"', '[serves.c]\nrole = "s"') + \
        '\n[roles.s]\ndevice = "GPU-sim-0"\ncapacity_mib = 500\n'
    plan = ap.rebalancer.plan(moved, "moved.toml").to_json()
    [c] = [s for s in plan["serves"] if s["name"] == "c"]
    assert (c["state_after"], c["mib_after"]) == ("declared", None)
    result = await ap.run(moved)
    assert result["result"] == "applied"
    assert ap.names() == ["validate", "backup", "release", "write", "reload", "verify"]
    assert "c" not in [u.serve for u in r.units.started]
    assert r.state("c") == "declared" and r.held() == {"a": 350, "b": 150}


async def test_backups_beyond_the_limit_are_removed(ap: Apply) -> None:
    times = [1_000_000.0, 1_000_001.0, 1_000_002.0]
    made = [backup(ap.path, 2, t) for t in times]
    kept = sorted((ap.path.parent / "backups").iterdir())
    assert kept == made[1:]
    assert all(p.read_text() == ap.old for p in kept)


async def test_a_backup_that_cannot_be_made_is_a_gpud_error(ap: Apply) -> None:
    missing = ap.path.parent / "missing.toml"
    with pytest.raises(GpudError, match=f"cannot back up {missing} to "):
        backup(missing, 2, 1.0)
    assert list((ap.path.parent / "backups").iterdir()) == []  # no half-made copy left


# ---- failures and their rollback ------------------------------------------------------------


async def test_a_serve_that_does_not_come_up_rolls_everything_back(ap: Apply) -> None:
    r = ap.rig
    new = resized(ap.old)
    starts = 0
    real_start = r.units.start

    async def start(spec: Any, timeout: float) -> Any:
        nonlocal starts
        starts += 1
        if spec.serve == "d":
            raise JobFailed("d's job failed")
        return await real_start(spec, timeout)

    r.units.start = start  # type: ignore[method-assign]
    result = await ap.run(new)
    assert result["result"] == "rolled-back"
    assert result["error"].startswith("d did not become healthy: launch failed: d's job failed")
    assert ap.path.read_text() == ap.old  # the old file is back
    assert r.svc.config_text == ap.old
    assert set(r.svc.config.serves) == {"a", "b", "c"}
    assert r.held() == {"a": 300, "b": 200}  # every serve back on its old figures
    assert r.state("a") == RUNNING and r.state("b") == RUNNING
    assert "d" not in r.svc.ledger.reservations
    assert r.svc.store.meta(JOURNAL) is None
    rollback = [s["message"] for s in ap.steps if s["step"] == "rollback"]
    assert "old config written back and reloaded" in rollback
    assert any(m.startswith("a: back to running") for m in rollback)
    assert any(m.startswith("d: back to ") for m in rollback)
    assert ap.names()[-1] == "rollback" and "failed" in ap.names()


async def test_a_failed_reload_during_apply_rolls_back(ap: Apply) -> None:
    ap.fail_reload_at = {1}
    result = await ap.run(resized(ap.old))
    assert result["result"] == "rolled-back"
    assert result["error"] == "reload refused for the test"
    assert ap.path.read_text() == ap.old
    assert ap.rig.held() == {"a": 300, "b": 200}
    assert ap.rig.svc.config_text == ap.old  # never changed: no second reload needed
    assert len(ap.reloads) == 1


async def test_a_rollback_whose_reload_fails_says_so(ap: Apply) -> None:
    r = ap.rig
    r.units.fail_start = JobFailed("nothing starts")
    ap.fail_reload_at = {2}
    result = await ap.run(resized(ap.old))
    assert result["result"] == "rolled-back"
    messages = [s["message"] for s in ap.steps if s["step"] == "rollback"]
    assert any(m.startswith("old config written back but not reloaded: reload refused")
               for m in messages)
    assert ap.path.read_text() == ap.old


async def test_a_file_changed_during_the_apply_is_not_written_over(ap: Apply) -> None:
    r = ap.rig
    ap.on_step["write"] = lambda: ap.path.write_text("# someone else's edit\n")
    r.units.fail_start = JobFailed("nothing starts")
    result = await ap.run(resized(ap.old))
    assert result["result"] == "rolled-back"
    assert ap.path.read_text() == "# someone else's edit\n"
    [last] = [s for s in ap.steps if s["step"] == "rollback" and not s["ok"]]
    assert "changed on disk since the apply began: not written over" in last["message"]


async def test_an_unreadable_file_at_rollback_is_not_written_over(ap: Apply) -> None:
    r = ap.rig
    ap.on_step["write"] = ap.path.unlink
    r.units.fail_start = JobFailed("nothing starts")
    result = await ap.run(resized(ap.old))
    assert result["result"] == "rolled-back"
    assert not ap.path.exists()


async def test_a_backup_failure_rolls_back_before_anything_changed(ap: Apply) -> None:
    (ap.path.parent / "backups").write_text("not a folder")
    result = await ap.run(resized(ap.old))
    assert result["result"] == "rolled-back"
    assert result["error"].startswith(f"cannot back up {ap.path} to ")
    assert result["backup"] is None
    assert ap.rig.svc.store.meta(JOURNAL) is None  # no apply left to recover at the next start
    assert ap.path.read_text() == ap.old
    assert ap.rig.held() == {"a": 300, "b": 200}
    assert ap.rig.units.stopped == []


# ---- recovery of an apply gpud did not live to finish ----------------------------------------


async def journal(ap: Apply, record: dict[str, Any] | str) -> None:
    await ap.rig.svc.put_meta(JOURNAL, record if isinstance(record, str) else json.dumps(record))


async def test_nothing_to_recover(ap: Apply) -> None:
    rec = Recovery(ap.rig.svc, ap.path)
    assert rec.prepare() is False
    assert await rec.finish(ap.rig.sup, ap.reload) is None
    assert Recovery(ap.rig.svc, None).prepare() is False


async def test_a_broken_record_is_dropped(ap: Apply) -> None:
    await journal(ap, "{not json")
    assert Recovery(ap.rig.svc, ap.path).prepare() is False
    assert ap.rig.svc.store.meta(JOURNAL) is None
    await journal(ap, {"new": "x"})  # no "old"
    assert Recovery(ap.rig.svc, ap.path).prepare() is False


class Died(BaseException):
    """gpud stopping dead in the middle of an apply: nothing after it runs."""


async def test_an_apply_interrupted_after_its_reload_is_rolled_back_at_the_next_start(
        ap: Apply) -> None:
    r = ap.rig

    def die() -> None:
        raise Died

    ap.on_step["reload"] = die
    new = resized(ap.old)
    with pytest.raises(Died):
        await ap.run(new)
    assert r.svc.store.meta(JOURNAL) is not None  # what the next start finds
    rec = Recovery(r.svc, ap.path)
    assert rec.prepare() is True
    assert rec.text == new  # the reload had committed the new config: gpud starts under it
    message = await rec.finish(r.sup, ap.reload)
    assert message is not None
    assert message.startswith("apply interrupted (gpud stopped during it), rolled back as a "
                              "failed one would be; steps it had begun: ")
    assert "FAILED" not in message, message
    assert ap.path.read_text() == ap.old
    assert r.svc.config_text == ap.old
    assert r.svc.store.meta(JOURNAL) is None
    [ev] = [e for e in r.events(kinds=["apply"]) if e.details.get("step") == "recover"]
    assert ev.details["ok"] is False
