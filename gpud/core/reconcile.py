"""What a sleep-capable serve says it is, against what the ledger holds for it.

vLLM's sleep endpoints are not behind any authentication (dev mode): whoever reaches the port can
`POST /wake_up` or `POST /sleep?level=N`. gpud asks every sleep-capable serve `GET /is_sleeping`
at each health check (and when observation sees a sleeping serve draw over its reservation), and
this function says what the answer means for the ledger. The safe direction never moves memory:
a serve found asleep while reserved awake keeps its full reservation; a serve found awake while
reserved asleep draws its full size already, so it is admitted at that size when it fits, else
put back to sleep (or stopped, when that is how it is preempted).

vLLM 0.34 adds a third answer: a serve prepared for a process checkpoint (`POST
/checkpoint/prepare`, open to whoever reaches a sleep-mode serve's port) says `is_sleeping: true`
(its scheduler is paused: vllm/v1/engine/core.py:1202-1204 of 0.34.0) but is not asleep: its
weights stay on the device, its KV cache is released (core.py:1008-1010), and `/sleep` and
`/wake_up` fail until `POST /checkpoint/restore` (core.py:1110, :1153). gpud asks `GET
/checkpoint/status` when a 0.34 serve says it sleeps, and restores a prepared one: within its
reservation when it is held running; admitted awake first when it is held asleep (it was woken
to be prepared: preparing needs an awake engine, core.py:2487-2488), or stopped when its awake
size does not fit (it can be neither put back to sleep nor restored within its sleep
reservation).
"""

from __future__ import annotations

from enum import StrEnum

from gpud.core.vocab import RUNNING, SLEEPING, SleepAction


class Reconcile(StrEnum):
    AGREE = "agree"  # the ledger says what the serve says (or nothing to go on): nothing to do
    ADMIT_AWAKE = "admit-awake"  # woken outside gpud, fits: reserved at its full size
    SLEEP_AGAIN = "sleep-again"  # woken outside gpud, does not fit: put back to sleep
    STOP = "stop"  # woken outside gpud, does not fit, preempted by stopping: stopped
    SHOW_ASLEEP = "show-asleep"  # put to sleep outside gpud: reservation kept, shown sleeping
    RESTORE = "restore"  # prepared for a checkpoint outside gpud, held running: restored
    ADMIT_AWAKE_RESTORE = "admit-awake-restore"  # prepared while held asleep, fits: both


def reconcile(recorded: str, is_sleeping: bool | None, *, overdrawn: bool = False,
              awake_fits: bool, preemptible: str | None, prepared: bool = False) -> Reconcile:
    """What to do about a serve recorded `recorded` whose `GET /is_sleeping` said `is_sleeping`
    (None: no answer). `overdrawn`: observation sees it draw over its reservation (asleep, that
    is a serve awake whatever it answers, or does not). `awake_fits`: its awake size would be
    admitted now (strict admission on every role, its own draw counted back). `prepared`: its
    `GET /checkpoint/status` says preparing or prepared (vLLM 0.34)."""
    if prepared and recorded == RUNNING:
        return Reconcile.RESTORE
    if prepared and recorded == SLEEPING:
        return Reconcile.ADMIT_AWAKE_RESTORE if awake_fits else Reconcile.STOP
    if recorded == RUNNING:
        return Reconcile.SHOW_ASLEEP if is_sleeping is True else Reconcile.AGREE
    if recorded != SLEEPING:
        return Reconcile.AGREE  # starting, stopping, failed...: not a sleep to check
    awake = is_sleeping is False or (is_sleeping is None and overdrawn)
    if not awake:
        return Reconcile.AGREE
    if awake_fits:
        return Reconcile.ADMIT_AWAKE
    return Reconcile.STOP if preemptible == SleepAction.STOP else Reconcile.SLEEP_AGAIN


def disagrees(recorded: str, is_sleeping: bool | None, *, overdrawn: bool = False,
              prepared: bool = False) -> bool:
    """Whether the ledger and the serve disagree (before anything is decided about it)."""
    return reconcile(recorded, is_sleeping, overdrawn=overdrawn, awake_fits=True,
                     preemptible=None, prepared=prepared) is not Reconcile.AGREE
