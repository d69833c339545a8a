"""SIGHUP as gpud's daemon handles it: a reload, never before gpud is ready."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from gpud.config import parse_config
from gpud.core import answers
from gpud.daemon import Daemon
from tests.waiting import until, waiters

CONFIG = """
[daemon]
state_dir = "{tmp}"
"""


async def test_a_sighup_during_start_up_reloads_once_gpud_is_ready(tmp_path: Path) -> None:
    text = CONFIG.format(tmp=tmp_path)
    path = tmp_path / "gpud.toml"
    path.write_text(text)
    daemon = Daemon(parse_config(text, str(path)), config_path=path, notify=lambda _: None)
    reloads: list[Any] = []

    async def reload(uid: int | None, text: str | None = None, *,
                     during_apply: bool = False) -> answers.Reloaded:
        reloads.append(uid)
        return {"reloaded": True, "over_committed": [], "summary": ""}

    daemon.reload = reload  # type: ignore[method-assign]
    daemon._on_sighup()
    await until(lambda: waiters(daemon.ready) == 1, what="the signal's reload waiting")
    assert reloads == []  # reconciliation (and an apply's recovery) still under way
    daemon.ready.set()
    await asyncio.gather(*daemon._signal_tasks)
    assert reloads == [None]
    daemon._on_sighup()  # once ready, at once
    await asyncio.gather(*daemon._signal_tasks)
    assert reloads == [None, None]
