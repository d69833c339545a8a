"""Where a checkout may live: the sandbox shows it to gpud.service wherever a user may put one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.sandbox import hidden_by_private_tmp, interpreter_dirs, needs_bind


@pytest.mark.parametrize(("path", "hidden"), [
    ("/var/tmp/gpud", True),
    ("/tmp/gpud", True),
    ("/var/tmp", True),
    ("/root/src/gpud", False),
    ("/home/someone/gpud", False),
    ("/srv/gpud", False),
    ("/opt/gpud", False),
    ("/var/tmpfoo/gpud", False),
])
def test_private_tmp_turned_off_only_where_it_would_hide_the_checkout(path: str, hidden: bool) -> None:
    assert hidden_by_private_tmp([Path(path)]) is hidden


def test_checkout_under_tmp_is_bound_in() -> None:
    # /tmp is a fresh tmpfs inside the sandbox: a checkout there must be bound in
    assert needs_bind(Path("/tmp"))


def test_the_venvs_base_interpreter_is_among_what_must_be_visible() -> None:
    import os
    import sys

    dirs = interpreter_dirs()
    assert Path(sys.prefix).resolve() in dirs
    assert Path(os.path.realpath(sys.executable)).parent in dirs
