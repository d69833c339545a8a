"""The request bodies the API takes (docs/api.md): strict pydantic models, each a route's JSON
body. gpud.server.api validates requests with them; gpud.server.openapi describes them from the same models.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpud.core.config import MAX_MIB

CONFIG_BODY_LIMIT = 1024 * 1024


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Preempting(_Wire):
    # Put serves of lower priority on the role to sleep (or stop them) when it does not fit.
    preempt: bool = False
    dry_run: bool = False  # with preempt: the plan only, nothing started or put to sleep

    @model_validator(mode="after")
    def _dry_run_with_preempt(self) -> _Preempting:
        # A dry run of nothing else would be carried out for real: refused instead.
        if self.dry_run and not self.preempt:
            raise ValueError("dry_run goes with preempt (the dry run is of a preemption's plan); "
                             "without preempt nothing can be dry run")
        return self


class AdmitBody(_Preempting):
    mib: int = Field(gt=0, le=MAX_MIB)
    role: str | None = None


class StartBody(_Preempting):
    pass


class SleepBody(_Wire):
    level: int | None = Field(default=None, ge=1, le=2)


class ReleaseBody(_Wire):
    stop: bool = False


class ConfigBody(_Wire):
    config: str = Field(max_length=CONFIG_BODY_LIMIT)
    source: str | None = None


class CalibrateBody(_Wire):
    window_s: float = Field(default=600.0, ge=1, le=86400)


class EmptyBody(_Wire):
    pass
