"""No adapter names a serve's next state (issue 45): adapters report what happened
(gpud.core.serverecord.Happened) and the serve's one step decides the state. Checked on gpud's
syntax trees by tools/shape.py's finder; planted violations prove each check can fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.shape import state_namings

ROOT = Path(__file__).resolve().parents[1]


def test_no_adapter_names_a_serves_next_state() -> None:
    found = state_namings(ROOT)
    assert not found, "an adapter names a serve's next state:\n" + "\n".join(map(str, found))


PLANTED = [
    'svc.state_row("a", RUNNING)',
    "svc.state_row(serve, ADMITTED if res else DECLARED, why)",
    "await svc.store_event(ev, state=svc.state_row(serve, STOPPING))",  # found twice: row and keyword
    "await svc.admit(serve, 100, state=SLEEPING)",
    "await svc.admit(serve, 100, state=ServeState.SLEEPING)",
    "await svc.release(serve, next_state=undo.state_after or DECLARED)",
    'await svc.release(serve, next_state="failed")',
]


@pytest.mark.parametrize("line", PLANTED)
def test_a_planted_naming_is_found(tmp_path: Path, line: str) -> None:
    for where in ("gpud/sneaky.py", "gpud/life/supervisor/sneaky.py"):
        path = tmp_path / where
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"async def f(svc, serve, ev, res, why, undo):\n    {line}\n")
    found = state_namings(tmp_path)
    assert {s.path for s in found} == {"gpud/sneaky.py", "gpud/life/supervisor/sneaky.py"}
    assert all(s.where == "f" and s.line == 2 for s in found)


@pytest.mark.parametrize("line", [
    "await svc.store_event(ev, report=svc.report(serve, Happened.LAUNCHED))",
    "await svc.admit(serve, 100, happened=Happened.ASLEEP)",
    "await svc.release(serve, happened=Happened.ROLLED_BACK, back_to=undo.state_after)",
    "svc.state_of(serve) == RUNNING",  # a read is not a decision
    "await svc.admit(serve, 100, state=None)",
])
def test_a_report_or_a_read_is_not_a_naming(tmp_path: Path, line: str) -> None:
    (tmp_path / "gpud").mkdir()
    (tmp_path / "gpud" / "fine.py").write_text(
        f"async def f(svc, serve, ev, undo):\n    {line}\n")
    assert state_namings(tmp_path) == []


def test_the_core_and_the_one_writer_may_name_states(tmp_path: Path) -> None:
    (tmp_path / "gpud" / "core").mkdir(parents=True)
    (tmp_path / "gpud" / "core" / "rule.py").write_text(
        "def f(svc):\n    svc.state_row('a', RUNNING)\n")
    (tmp_path / "gpud" / "life").mkdir()
    (tmp_path / "gpud" / "life" / "service.py").write_text(
        "class LedgerService:\n    def _store_state(self, serve, state):\n"
        "        self.state_row(serve, state)\n"
        "    def elsewhere(self, serve, state):\n        self.state_row(serve, state)\n")
    [found] = state_namings(tmp_path)
    assert (found.path, found.where) == ("gpud/life/service.py", "LedgerService.elsewhere")
