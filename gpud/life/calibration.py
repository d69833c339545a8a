"""Calibration: measure a running serve's steady and peak draw over a window and recommend a
reservation, bound to the serve's fingerprint (gpud.core.launch.fingerprint) so that a changed serve
(new model, revision, quantization, command, max_model_len) shows as `stale`, not calibrated.

For a vllm serve it also reads vLLM's own account from the serve's journal (gpud.vllm.vllm_log:
weights, KV cache, CUDA graphs and vLLM's recommended --kv-cache-memory) and the context: what
NVML shows beyond vLLM's budget (util x total), which the reservation must include.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gpud.core import answers
from gpud.core.config import ServeConfig
from gpud.core.launch import (
    fingerprint,
    kv_cache_fit_mib,
    smallest_total,
    utilization,
    vllm_budget_mib,
)
from gpud.core.vocab import RUNNING, EventKind, serve_unit
from gpud.durable.store import Calibration, Changes
from gpud.errors import Conflict, GpudError, NotFound, Unavailable
from gpud.host.observer import Observer
from gpud.host.unit_journal import read_unit_journal
from gpud.life.service import LedgerService
from gpud.vllm.model_size import Sized, kv_at_reservation, size_serve
from gpud.vllm.vllm_log import budget_mib, context_mib, parse_memory_lines

log = logging.getLogger("gpud.calibration")

ROUND_MIB = 256


def recommend(samples: list[int], *, margin_pct: float = 5.0,
              min_margin_mib: int = 256) -> tuple[int, int, int]:
    """(steady, peak, recommended) from draw samples in MiB. Steady is the median; the
    recommendation is the peak plus a margin (a percentage, at least `min_margin_mib`), rounded
    up to 256 MiB."""
    if not samples:
        raise ValueError("no samples")
    steady = int(statistics.median(samples))
    peak = max(samples)
    margin = max(min_margin_mib, math.ceil(peak * margin_pct / 100))
    recommended = math.ceil((peak + margin) / ROUND_MIB) * ROUND_MIB
    return steady, peak, recommended


@dataclass
class Run:
    serve: str
    fingerprint: str
    window_s: float
    started: float
    samples: list[int] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    error: str | None = None

    def to_json(self, now: float) -> answers.CalibrationRun:
        return {"serve": self.serve, "fingerprint": self.fingerprint, "running": True,
                "window_s": self.window_s, "elapsed_s": round(now - self.started, 1),
                "samples": len(self.samples),
                "peak_mib": max(self.samples) if self.samples else None}


JournalReader = Callable[[str], Awaitable[list[str]]]


class Calibrator:
    def __init__(self, svc: LedgerService, observer: Observer, *,
                 clock: Callable[[], float] = time.time,
                 journal: JournalReader = read_unit_journal) -> None:
        self.svc = svc
        self.observer = observer
        self.clock = clock
        self.journal = journal
        self.runs: dict[str, Run] = {}
        self._records: dict[tuple[str, str], Calibration] = {}
        # serve -> (fingerprint, its prediction): a checkpoint is read once per fingerprint
        # serve -> (fingerprint and calibration, its prediction): a checkpoint is read once each
        self._predicted: dict[str, tuple[str, answers.Predicted]] = {}

    def load(self) -> None:
        self._records = {(c.serve, c.fingerprint): c for c in self.svc.store.calibrations()}

    async def close(self) -> None:
        tasks = [r.task for r in self.runs.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def fingerprint_of(self, serve: str) -> str | None:
        spec = self.svc.serve_spec(serve)
        return fingerprint(spec) if spec else None

    def calibration_of(self, serve: str) -> tuple[answers.CalibrationStatus, str | None]:
        """("calibrated" | "stale" | "uncalibrated", fingerprint)."""
        fp = self.fingerprint_of(serve)
        if fp is not None and (serve, fp) in self._records:
            return "calibrated", fp
        if any(s == serve for s, _ in self._records):
            return "stale", fp
        return "uncalibrated", fp

    def record_of(self, serve: str) -> Calibration | None:
        fp = self.fingerprint_of(serve)
        return self._records.get((serve, fp)) if fp else None

    def summary_of(self, serve: str) -> answers.Calibrated | None:
        """The current calibration in brief, for `gpuctl serves NAME`: the measured figures,
        the recommended reservation and vLLM's own account (None when not calibrated)."""
        rec = self.record_of(serve)
        if rec is None:
            return None
        return {"steady_mib": rec.steady_mib, "peak_mib": rec.peak_mib,
                "recommended_mib": rec.recommended_mib, "vllm": rec.vllm}

    def weights_mib(self, serve: str) -> int | None:
        """The weights the current calibration measured (vLLM's account), if any: what a
        level-1 sleep parks in host RAM."""
        rec = self.record_of(serve)
        if rec is None or not rec.vllm or rec.vllm.get("weights_mib") is None:
            return None
        return int(rec.vllm["weights_mib"])

    def cudagraph_mib(self, serve: str) -> int | None:
        """The CUDA graph pool the current calibration measured (vLLM's account), if any: what
        vLLM 0.34 parks in host RAM at either sleep level beside what the level parks."""
        rec = self.record_of(serve)
        if rec is None or not rec.vllm or rec.vllm.get("cudagraph_mib") is None:
            return None
        return int(rec.vllm["cudagraph_mib"])

    def sizing_problem(self, serve: str) -> str | None:
        """A vllm serve that sizes its KV cache itself (kv_cache_mib) must fit what its current
        calibration says it holds beside it: weights + CUDA graphs + context + KV <= vram_mib.
        Why not, or None (also when there is nothing calibrated to go by)."""
        spec = self.svc.serve_spec(serve)
        rec = self.record_of(serve)
        if spec is None or spec.vllm is None or not isinstance(spec.vllm.kv_cache_mib, int) \
                or rec is None or not rec.vllm or rec.vllm.get("weights_mib") is None:
            return None
        weights = int(rec.vllm["weights_mib"])
        graphs = int(rec.vllm.get("cudagraph_mib") or 0)
        measured = rec.vllm.get("context_mib")
        context = int(measured if measured is not None else spec.vllm.context_mib or 0)
        need = weights + graphs + context + spec.vllm.kv_cache_mib
        if need <= spec.vram_mib:
            return None
        return (f"calibrated need {need} MiB (weights {weights} + CUDA graphs {graphs} + context "
                f"{context} + kv_cache_mib {spec.vllm.kv_cache_mib}) exceeds vram_mib "
                f"{spec.vram_mib}: vLLM would draw past its reservation")

    def kv_cache_figure(self, serve: str) -> int | None:
        """The KV cache (MiB) the serve's current calibration gives (kv_cache_mib =
        "calibrated"), or None."""
        spec = self.svc.serve_spec(serve)
        rec = self.record_of(serve)
        if spec is None or rec is None or not rec.vllm:
            return None
        return kv_cache_fit_mib(spec.vram_mib, rec.vllm)[0]

    def predicted(self, serve: str) -> answers.Predicted | None:
        """What the serve's checkpoint on disk says it needs (None: not a vllm serve), and what
        its reservation leaves for the KV cache: with the overheads its current calibration
        measured once there is one (as Ollama replaces its estimate with what the engine
        logged), else gpud's estimate, each deduction saying which."""
        spec = self.svc.serve_spec(serve)
        if spec is None or spec.vllm is None:
            return None
        fp = fingerprint(spec)
        rec = self.record_of(serve)
        key = f"{fp}@{rec.ts if rec is not None else ''}"
        hit = self._predicted.get(serve)
        if hit is not None and hit[0] == key:
            return hit[1]
        sized = size_serve(spec, self.svc.config.daemon)
        n = sized.need
        found: answers.Predicted = {
            "weights_mib": sized.weights.mib if sized.weights else None,
            "kv_mib": n.kv_mib if n else None, "context_mib": n.context_mib if n else None,
            "minimum_mib": n.minimum_mib if n else None,
            "max_model_len": n.max_model_len if n else None,
            "how": (f"{n.arithmetic()}; weights {sized.weights.how if sized.weights else ''}, "
                    f"read from {sized.where}" if n
                    else sized.unknown or sized.error or "unknown until its first start")}
        if n is not None and sized.weights is not None and sized.kv is not None \
                and sized.config is not None:
            found["kv"] = self._at_reservation(spec, sized, n.max_model_len,
                                               rec.vllm if rec is not None else None)
        self._predicted[serve] = (key, found)
        return found

    def _at_reservation(self, spec: ServeConfig, sized: Sized, max_model_len: int,
                        figures: dict[str, Any] | None) -> answers.PredictedKv:
        roles = [self.svc.ledger.roles.get(r) for r in spec.all_roles]
        total = smallest_total([self.observer.device_total(r.device) if r else None
                                for r in roles])
        return kv_at_reservation(spec, self.svc.config.daemon, sized, max_model_len, figures,
                                 device_mib=total)

    def view(self, serve: str) -> answers.Calibration:
        status, fp = self.calibration_of(serve)
        spec = self.svc.serve_spec(serve)
        out: answers.Calibration = {"serve": serve, "status": status, "fingerprint": fp,
                               "running": None, "record": None}
        predicted = self.predicted(serve)
        if predicted is not None:
            out["predicted"] = predicted
        run = self.runs.get(serve)
        if run is not None:
            out["running"] = run.to_json(self.clock())
        rec = self.record_of(serve) or max(
            (c for (s, _), c in self._records.items() if s == serve), key=lambda c: c.ts,
            default=None)
        if rec is not None:
            out["record"] = {"fingerprint": rec.fingerprint, "ts": rec.ts,
                             "window_s": rec.window_s, "samples": rec.samples,
                             "steady_mib": rec.steady_mib, "peak_mib": rec.peak_mib,
                             "recommended_mib": rec.recommended_mib,
                             "current": rec.fingerprint == fp}
            out["vllm"] = rec.vllm
            if rec.vllm and spec is not None:
                # the figure for vllm.kv_cache_mib (exactly sized: starts beside its neighbours)
                fit, how = kv_cache_fit_mib(spec.vram_mib, rec.vllm)
                out["vllm"] = {**rec.vllm, "kv_cache_fit_mib": fit, "kv_cache_fit": how}
        return out

    async def vllm_figures(self, serve: str, steady_mib: int) -> dict[str, Any] | None:
        """vLLM's start-up memory lines from the serve's journal, and the context: the steady
        draw beyond vLLM's budget (util x total of the current reservation)."""
        spec = self.svc.serve_spec(serve)
        if spec is None or spec.vllm is None:
            return None
        figures: dict[str, Any] = parse_memory_lines(
            await self.journal(serve_unit(serve))).to_json()
        res = self.svc.ledger.reservations.get(serve)
        roles = [self.svc.ledger.roles.get(r) for r in spec.all_roles]
        totals = [self.observer.device_total(r.device) if r else None for r in roles]
        total = smallest_total(totals)
        figures["context_mib"] = None
        if res is not None and total and not isinstance(spec.vllm.kv_cache_mib, int) \
                and vllm_budget_mib(spec, res.mib) * 10_000 >= total:
            budget = budget_mib(utilization(serve, vllm_budget_mib(spec, res.mib), total), total)
            figures["budget_mib"] = budget
            # The budget already leaves vllm.context_mib out: what is beyond it is all context.
            figures["context_mib"] = context_mib(steady_mib, budget)
        return figures

    def _sample(self, serve: str) -> int | None:
        """The serve's draw for calibration: on one device, its draw; on several, the largest
        of its per-device draws (its reservation is per device, the same on each)."""
        spec = self.svc.serve_spec(serve)
        if spec is not None and spec.extra_roles:
            per = self.observer.observed_by_device(serve)
            return None if per is None else max(per.values(), default=0)
        return self.observer.observed_mib(serve)

    def start(self, serve: str, window_s: float, uid: int | None) -> answers.CalibrationRun:
        spec = self.svc.serve_spec(serve)
        if spec is None:
            raise NotFound(f"unknown serve {serve!r}: only configured serves are calibrated",
                           {"serve": serve})
        if serve in self.runs:
            raise Conflict(f"{serve} is already being calibrated", {"serve": serve})
        if self.svc.state_of(serve) != RUNNING:
            raise Conflict(f"{serve} is {self.svc.state_of(serve)}: calibration measures a "
                           "running serve", {"serve": serve, "state": self.svc.state_of(serve)})
        if not self.observer.available:
            raise Unavailable("observation unavailable: nothing to measure with")
        run = Run(serve, fingerprint(spec), window_s, self.clock())
        self.runs[serve] = run
        run.task = asyncio.get_running_loop().create_task(self._measure(run, uid))
        run.task.add_done_callback(lambda task: _report_crash(run.serve, task))
        return run.to_json(self.clock())

    async def _measure(self, run: Run, uid: int | None) -> None:
        try:
            # The window on the injected clock, the one run.started and elapsed_s are read on.
            deadline = run.started + run.window_s
            while self.clock() < deadline:
                await self.observer.next_sample(self.observer.interval * 2 + 1)
                if self.svc.state_of(run.serve) != RUNNING:
                    raise Conflict(f"{run.serve} stopped running during calibration")
                mib = self._sample(run.serve)
                if mib is not None:
                    run.samples.append(mib)
            if not run.samples:
                raise Unavailable("no samples: observation gave nothing for the serve")
            steady, peak, recommended = recommend(run.samples)
            spec = self.svc.serve_spec(run.serve)
            reserved = spec.vram_mib if spec else None
            vllm = await self.vllm_figures(run.serve, steady)
            cal = Calibration(run.serve, run.fingerprint, self.clock(), run.window_s,
                              len(run.samples), steady, peak, recommended, vllm)
            said = ""
            if vllm is not None and vllm.get("weights_mib") is not None:
                said = (f"; vLLM: weights {vllm['weights_mib']} MiB, KV cache "
                        f"{vllm['kv_cache_mib']} MiB, CUDA graphs {vllm['cudagraph_mib']} MiB, "
                        f"context {vllm['context_mib']} MiB")
            ev = self.svc.event(
                EventKind.CALIBRATE, f"{run.serve} calibrated over {run.window_s:g} s: steady "
                f"{steady} MiB, peak {peak} MiB, recommended {recommended} MiB (configured "
                f"{reserved} MiB){said}", serve=run.serve, mib=recommended, uid=uid,
                fingerprint=run.fingerprint, steady_mib=steady, peak_mib=peak,
                samples=len(run.samples),
                **{f"vllm_{k}": v for k, v in (vllm or {}).items()})
            async with self.svc.lock:
                await self.svc.commit(Changes(calibrations=[cal], events=[ev]))
            self._records[(cal.serve, cal.fingerprint)] = cal
        except GpudError as exc:
            # What can fail: the serve stopped running (Conflict), observation gave nothing
            # (Unavailable), the store did not take the record (StoreError). Reported in the
            # event log; the daemon goes on. Anything else is a fault: see _report_crash.
            message = exc.message
            log.warning("calibration of %s failed: %s", run.serve, message)
            await self.svc.store_event(self.svc.event(
                EventKind.CALIBRATE, f"{run.serve}: calibration failed: {message}", serve=run.serve,
                uid=uid, failed=True))
        finally:
            self.runs.pop(run.serve, None)


def _report_crash(serve: str, task: asyncio.Task[None]) -> None:
    """A measurement that ended on an exception other than GpudError is a fault of gpud: logged
    with its traceback, not passed off as a calibration that failed for a reason."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.error("calibration of %s crashed: %s", serve, exc, exc_info=exc)
