"""Sample on-demand facts and bring-up policy for the tests of gpud.core.demand's events and of
the serve record that holds them (gpud.core.serverecord)."""

from __future__ import annotations

from gpud.core.bringup import Policy, Tries
from gpud.core.demand import Demand

POLICY = Policy(refusal_hold_s=5, first_s=2, max_s=60, stable_s=30)
# every fact known: a failure counted, idling, each time and the memory it needs
KNOWN = Demand(tries=Tries(failures=2, not_before=9.0), failure_counted=True, idling=True,
               last_activity=3.0, last_request=4.0, up_at=5.0, need_mib=700)
