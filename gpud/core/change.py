"""One serve's row of a rebalance plan: what the new config does to it, before and after. The
plan (gpud.core.plan) makes these rows; the apply's steps (gpud.core.actions) are read from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpud.core import answers
from gpud.core.vocab import Gone, ServeState


@dataclass(frozen=True)
class ServeChange:
    name: str
    role_before: str | None
    role_after: str | None
    mib_before: int | None  # the reservation held now (None: none)
    mib_after: int | None  # the reservation it would hold (None: none)
    util_before: str | None
    util_after: str | None
    fingerprint_before: str | None
    fingerprint_after: str | None
    state_before: ServeState
    state_after: ServeState | Gone
    change: str  # unchanged, resized, changed, "changed, resized", added, removed
    restart: bool
    reason: str | None = None
    resident: bool = False  # by the new config (a serve it removes: False)

    def to_json(self) -> answers.PlanServe:
        return {"name": self.name, "role_before": self.role_before, "role_after": self.role_after,
                "mib_before": self.mib_before, "mib_after": self.mib_after,
                "util_before": self.util_before, "util_after": self.util_after,
                "fingerprint_before": self.fingerprint_before,
                "fingerprint_after": self.fingerprint_after, "state_before": self.state_before,
                "state_after": self.state_after, "change": self.change, "restart": self.restart,
                "reason": self.reason}
