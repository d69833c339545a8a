"""The HTTP/JSON API on the Unix socket (docs/api.md).

Every route is authorized from the peer's credentials (SO_PEERCRED): reads for anyone who can
open the socket, mutations for uid 0 or the admin group, the front's own route (an on-demand
serve's ensure) for uid 0 or the front's user. A route is a mutation unless it is registered as
something else; nothing is public except on the optional metrics listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import logging
import pwd
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from aiohttp import web

from gpud.core import answers
from gpud.core.authority import needs_root
from gpud.core.bodies import (
    CONFIG_BODY_LIMIT,
    AdmitBody,
    CalibrateBody,
    ConfigBody,
    EmptyBody,
    ReleaseBody,
    SleepBody,
    StartBody,
)
from gpud.core.quota import BudgetState
from gpud.core.router import (
    ANONYMOUS,
    EnsureBound,
    model_name_problem,
    router_request,
)
from gpud.core.usage import hour_of, summarize
from gpud.core.vocab import EVENT_KINDS, ApplyOutcome, EventKind, ServeState, StepKind
from gpud.durable.store import Event, EventQuery
from gpud.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    GpudError,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    Unavailable,
)
from gpud.life.offload import Offload
from gpud.life.rebalance import Rebalancer
from gpud.life.service import LedgerService, check_serve_name
from gpud.nginx.front import not_listening
from gpud.server.connguard import Guarded
from gpud.server.metrics import METRICS_CONTENT_TYPE
from gpud.server.reading import int_param, parse_since, read_model
from gpud.server.responses import error_response, json_response, status_page, too_many_waiting
from gpud.server.views import (
    DrawSource,
    figures_of_each_role,
    figures_view,
    ledger_view,
    route_choice,
    serve_view,
    serves_view,
)

if TYPE_CHECKING:
    from gpud.server.ondemand import OnDemand

log = logging.getLogger("gpud.api")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)

# "front": only uid 0 and daemon.front_user, whatever their groups (the on-demand check)
Access = Literal["read", "admin", "public", "front"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Credentials:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


def peer_of(request: web.Request) -> Credentials | None:
    """The credentials of the process at the other end of a Unix socket; None over TCP."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups: set[int] = {gid}
    try:
        data = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 256)
        groups.update(struct.unpack(f"{len(data) // 4}I", data))
    except OSError:
        pass
    return Credentials(pid, uid, gid, frozenset(groups))


def admin_gid(group: str) -> int | None:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None


def may_mutate(peer: Credentials | None, admin_group_gid: int | None) -> bool:
    if peer is None:
        return False
    return peer.uid == 0 or (admin_group_gid is not None and admin_group_gid in peer.groups)


class Preempting(Protocol):
    async def admit_preempting(self, serve: str, mib: int, uid: int | None, *,
                               dry_run: bool = False) -> dict[str, Any]: ...
    def what_preemption_would_do(self, serve: str, mib: int) -> tuple[str, dict[str, Any]]: ...
    def preemption_hint(self, serve: str, mib: int) -> contextlib.AbstractContextManager[None]: ...


class SleepControl(Protocol):
    async def sleep(self, serve: str, uid: int | None, level: int | None = None) -> dict[str, Any]: ...
    async def wake(self, serve: str, uid: int | None) -> dict[str, Any]: ...
    def parked_mib(self, serve: str) -> int | None: ...
    @property
    def preemption(self) -> Preempting: ...


class StartPart(Protocol):
    async def start(self, serve: str, uid: int | None, *, wait: bool = False,
                    preempt: bool = False) -> dict[str, Any] | None: ...


class Supervisor(Protocol):
    """The supervisor's parts the API asks (gpud.life.supervisor.Supervisor): the sleeps, a
    start, and its own stop and restart (an operator's)."""

    @property
    def sleeps(self) -> SleepControl: ...
    @property
    def launch_job(self) -> StartPart: ...
    async def stop(self, serve: str, uid: int | None) -> None: ...
    async def restart(self, serve: str, uid: int | None) -> None: ...


class Calibrations(Protocol):
    def calibration_of(self, serve: str) -> tuple[answers.CalibrationStatus, str | None]: ...

    def summary_of(self, serve: str) -> answers.Calibrated | None: ...

    def view(self, serve: str) -> answers.Calibration: ...

    def start(self, serve: str, window_s: float, uid: int | None) -> answers.CalibrationRun: ...


class Api:
    def __init__(self, svc: LedgerService, *, draws: DrawSource | None = None,
                 supervisor: Supervisor | None = None,
                 calibrations: Calibrations | None = None,
                 metrics: Callable[[], str] | None = None,
                 reload: Callable[[int | None], Awaitable[answers.Reloaded]] | None = None,
                 rebalancer: Rebalancer | None = None,
                 extra_routes: Callable[[Api], None] | None = None,
                 offload: Offload | None = None,
                 on_demand: OnDemand | None = None,
                 front_degraded: Callable[[], tuple[str, ...]] | None = None,
                 peers: Callable[[], answers.Peers] | None = None,
                 budgets: Callable[[], Sequence[BudgetState]] | None = None) -> None:
        self.svc = svc
        self.draws = draws
        self.supervisor = supervisor
        self.calibrations = calibrations
        self.metrics = metrics
        self.reload_hook = reload
        self.rebalancer = rebalancer
        self.on_demand = on_demand
        # what the front's last sync left dark (gpud.nginx.front.Front.degraded; None: no front)
        self.front_degraded = front_degraded
        # what this host knows of its peers (gpud.host.peers.PeerPoller.answer; None: no peers)
        self.peers: Callable[[], answers.Peers] = peers or (lambda: {"peers": []})
        # each budgeted key's use of its token budgets now (GET /v1/usage; in a thread; None:
        # no budgets known)
        self.budgets = budgets
        # the ensures under way, by requester (daemon.ensure_waiting_*: set at each ensure,
        # so that a reload's new bounds hold at once)
        self.ensures = EnsureBound.empty(svc.config.daemon.ensure_waiting_per_requester,
                                         svc.config.daemon.ensure_waiting_total)
        # parsing and planning configs: off the loop, at most a few per peer at a time
        self.offload = offload if offload is not None else Offload()
        self.admin_gid = admin_gid(svc.config.daemon.admin_group)
        self._access: dict[str, Access] = {}
        self.app = web.Application(middlewares=[self._errors, self._authorize],
                                   client_max_size=CONFIG_BODY_LIMIT)
        self.route("GET", "/v1/status", self.status, "read")
        self.route("GET", "/v1/ledger", self.ledger, "read")
        self.route("GET", "/v1/serves", self.serves, "read")
        self.route("GET", "/v1/serves/{name}", self.serve, "read")
        self.route("GET", "/v1/events", self.events, "read")
        self.route("GET", "/v1/usage", self.usage, "read")
        self.route("GET", "/v1/peers", self.peer_views, "read")
        self.route("GET", "/v1/route", self.route_choice, "read")
        self.route("GET", "/v1/openapi.json", self.openapi, "read")
        self.route("GET", "/ui", self.page, "read")
        self.route("GET", "/metrics", self.metrics_text, "read")
        self.route("POST", "/v1/serves/{name}/admit", self.admit)
        self.route("POST", "/v1/serves/{name}/release", self.release)
        self.route("POST", "/v1/serves/{name}/start", self.start)
        self.route("POST", "/v1/serves/{name}/stop", self.stop)
        self.route("POST", "/v1/serves/{name}/restart", self.restart)
        self.route("POST", "/v1/serves/{name}/sleep", self.sleep)
        self.route("POST", "/v1/serves/{name}/wake", self.wake)
        self.route("POST", "/v1/reload", self.reload)
        self.route("POST", "/v1/plan", self.plan, "read")  # computes, changes nothing
        self.route("POST", "/v1/apply", self.apply)
        self.route("GET", "/v1/serves/{name}/calibration", self.calibration, "read")
        self.route("POST", "/v1/serves/{name}/calibrate", self.calibrate)
        self.route("POST", "/v1/serves/{name}/ensure", self.ensure, "front")
        if extra_routes:
            extra_routes(self)

    def config_changed(self) -> None:
        """The config in force changed (reload): the admin group may be another one."""
        self.admin_gid = admin_gid(self.svc.config.daemon.admin_group)

    def route(self, method: str, path: str, handler: Handler, access: Access = "admin") -> None:
        """Register a route. Anything not registered as "read" or "public" needs an admin."""
        self.app.router.add_route(method, path, handler)
        self._access[f"{method} {path}"] = access

    # ---- middlewares -----------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # The connection's deadline (gpud.server.connguard): the body must arrive by it (read_json).
        transport = request.transport
        guard = transport.get_protocol() if transport is not None else None
        if not isinstance(guard, Guarded):
            return await self._answer(request, handler)
        request["deadline"] = guard.request_began()
        try:
            return await self._answer(request, handler)
        finally:
            guard.request_done()

    async def _answer(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestTimeout as exc:
            log.warning("%s %s: %s", request.method, request.path, exc.message)
            resp = error_response(exc)
            resp.force_close()  # what is left of the body is not read
            return resp
        except GpudError as exc:
            if isinstance(exc, Unavailable):
                # a state of the host (no system bus, no NVML), answered as designed: not a fault
                log.warning("%s %s: %s", request.method, request.path, exc.message)
            elif exc.http_status >= 500:
                log.error("%s %s: %s", request.method, request.path, exc.message)
            return error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            return error_response(PayloadTooLarge(
                f"request body over the limit of {CONFIG_BODY_LIMIT} bytes",
                {"limit": CONFIG_BODY_LIMIT}))
        except web.HTTPNotFound:
            return error_response(NotFound(f"no such route: {request.method} {request.path}"))
        except web.HTTPMethodNotAllowed as exc:
            err = BadRequest(f"method {request.method} not allowed on {request.path}",
                             {"allowed": sorted(exc.allowed_methods)})
            resp = error_response(err)
            resp.set_status(405)
            return resp
        except web.HTTPException:
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # the one place a bug becomes a 500 instead of a dead daemon
            log.exception("%s %s failed", request.method, request.path)
            return error_response(GpudError(f"internal error: {type(exc).__name__}"))

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        info = request.match_info.route.resource
        key = f"{request.method} {info.canonical}" if info else ""
        access = self._access.get(key, "admin")
        peer = peer_of(request)
        request["peer"] = peer
        if access == "public":
            return await handler(request)
        if peer is None and request.transport is not None:
            # The TCP metrics listener: only /metrics, nothing else.
            if key == "GET /metrics":
                return await handler(request)
            raise Forbidden("only /metrics is served on the TCP listener")
        if access == "front":
            self._front_only(peer)
            return await handler(request)
        if access == "admin" and not self.svc.ready:
            # Before reconciliation a change could race the adoption of running units.
            raise Unavailable("gpud is starting (reconciling running serves): try again in a "
                              "moment", {"retry": True})
        if access == "admin" and not may_mutate(peer, self.admin_gid):
            group = self.svc.config.daemon.admin_group
            uid = peer.uid if peer else None
            log.warning("refused %s %s from uid %s", request.method, request.path, uid,
                        extra={"journal": {"GPUD_EVENT": EventKind.FORBIDDEN, "GPUD_UID": uid}})
            raise Forbidden(
                f"uid {uid} may read but not change the ledger: mutations need root or "
                f"membership of group {group!r}",
                {"uid": uid, "admin_group": group},
            )
        return await handler(request)

    def _front_only(self, peer: Credentials | None) -> None:
        user = self.svc.config.daemon.front_user
        if peer is None or peer.uid not in (0, _uid_of(user)):
            uid = peer.uid if peer else None
            log.warning("refused the front's route from uid %s", uid,
                        extra={"journal": {"GPUD_EVENT": EventKind.FORBIDDEN, "GPUD_UID": uid}})
            raise Forbidden(f"uid {uid}: only the front ({user}) and root may ensure a serve",
                            {"uid": uid, "front_user": user})

    # ---- reads -----------------------------------------------------------------------------

    def observation_status(self) -> answers.Observation:
        obs = self.svc.observer
        status = getattr(obs, "status", None)
        if callable(status):
            return status()  # type: ignore[no-any-return]
        return {"backend": "none", "available": False, "simulated": False,
                "reason": "no observation backend configured"}

    async def status(self, request: web.Request) -> web.Response:
        doc = self.svc.status_view(self.observation_status())
        degraded = list(self.front_degraded()) if self.front_degraded is not None else []
        if self.front_degraded is not None:
            doc["front"] = {"degraded": degraded}
        r = self.svc.config.router
        if r is not None:
            # A connection that sends nothing, closed at once: nginx answers no request and
            # logs none for it (gpud.nginx.front.not_listening).
            dark = await not_listening(frozenset({r.listen}), wait_s=0)
            doc["router"] = {"listen": r.listen, "listening": not dark, "degraded": [
                d for d in degraded if d.startswith("router") or r.listen in d]}
        return json_response(doc)

    async def page(self, request: web.Request) -> web.Response:
        """The status page (gpud/data/status.html): one self-contained document whose script
        reads this API's own read routes, on the same socket, under the same rule."""
        text, script_hash = status_page()
        return web.Response(text=text, content_type="text/html", headers={
            # its one inline script and nothing else runs; it reaches only this origin
            "Content-Security-Policy": (
                f"default-src 'none'; script-src 'sha256-{script_hash}'; "
                "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; "
                "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store",
        })

    async def ledger(self, request: web.Request) -> web.Response:
        return json_response(ledger_view(self.svc, self.draws))

    def _calibrations(self) -> dict[str, tuple[answers.CalibrationStatus, str | None]]:
        if self.calibrations is None:
            return {}
        return {n: self.calibrations.calibration_of(n) for n in self.svc.known_serves()}

    async def serves(self, request: web.Request) -> web.Response:
        summaries = ({n: self.calibrations.summary_of(n) for n in self.svc.known_serves()}
                     if self.calibrations else {})
        return json_response(serves_view(self.svc, self.draws, self._calibrations(),
                                         summaries, self._parked, self._activity,
                                         self._in_flight, self._bringups, self._queued,
                                         self._queue))

    def _serve_view(self, name: str) -> answers.Serve:
        if self.calibrations is None:
            return serve_view(self.svc, name, self.draws, parked=self._parked,
                              activity=self._activity, in_flight=self._in_flight,
                              bringups=self._bringups, queued=self._queued,
                              queue=self._queue)
        return serve_view(self.svc, name, self.draws, self.calibrations.calibration_of(name),
                          self.calibrations.summary_of(name), self._parked, self._activity,
                          self._in_flight, self._bringups, self._queued, self._queue)

    def _bringups(self, serve: str) -> tuple[float | None, float | None]:
        """The medians of SERVE's measured wakes and starts (gpud.life.counts)."""
        if self.on_demand is None:
            return None, None
        return (self.on_demand.bringup_s(serve, StepKind.WAKE),
                self.on_demand.bringup_s(serve, StepKind.START))

    def _activity(self, serve: str) -> float | None:
        return self.on_demand.activity_s_ago(serve) if self.on_demand is not None else None

    def _queue(self, serve: str) -> tuple[list[answers.QueuePlace], float | None,
                                          answers.ServeWaiting | None] | None:
        """Who waits for SERVE in the router's queue, and the wait to expect (None: nobody)."""
        return self.on_demand.queue_of(serve) if self.on_demand is not None else None

    def _queued(self, serve: str) -> int:
        """Requests waiting in the router's queue for SERVE (gpud.life.ondemand)."""
        return len(self.on_demand.queued.get(serve, ())) if self.on_demand is not None else 0

    def _in_flight(self, serve: str) -> int | None:
        return self.on_demand.in_flight(serve) if self.on_demand is not None else None

    def _parked(self, serve: str) -> int | None:
        """Host RAM a sleeping serve's weights are parked in (level 1)."""
        return self.supervisor.sleeps.parked_mib(serve) if self.supervisor is not None else None

    def _known(self, request: web.Request) -> str:
        name = request.match_info["name"]
        check_serve_name(name)
        if name not in self.svc.known_serves():
            raise NotFound(f"unknown serve {name!r}", {"serve": name})
        return name

    async def serve(self, request: web.Request) -> web.Response:
        return json_response(self._serve_view(self._known(request)))

    async def events(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        unknown = set(q) - {"serve", "role", "kind", "since", "limit", "follow", "after"}
        if unknown:
            raise BadRequest(f"unknown query parameter {sorted(unknown)[0]!r}")
        bad_kinds = sorted(set(q.getall("kind", [])) - set(EVENT_KINDS))
        if bad_kinds:
            raise BadRequest(f"unknown event kind {bad_kinds[0]!r}",
                             {"kinds": list(EVENT_KINDS)})
        limit = int_param(q.get("limit"), "limit", 100, 1, 10000)
        after = int_param(q.get("after"), "after", 0, 0, 2**62) if "after" in q else None
        query = EventQuery(
            serves=q.getall("serve", []), roles=q.getall("role", []), kinds=q.getall("kind", []),
            since=parse_since(q["since"]) if "since" in q else None, after_id=after, limit=limit,
        )
        if q.get("follow") not in (None, "", "0", "false"):
            return await self._follow(request, query)
        events = await self.svc.events(query)
        answer: answers.Events = {"events": [e.to_json() for e in events]}
        return json_response(answer)

    async def peer_views(self, request: web.Request) -> web.Response:
        """The peers of the config in force, as the poller last found them (docs/peers.md)."""
        return json_response(self.peers())

    async def route_choice(self, request: web.Request) -> web.Response:
        """Which host takes a request for `model` now (docs/peers.md, "Which host"): this one,
        a peer whose circuit is closed, or none (gpud.server.views.route_choice). The router
        asks it only for a model on more than one host."""
        q = request.query
        unknown = set(q) - {"model"}
        if unknown:
            raise BadRequest(f"unknown query parameter {sorted(unknown)[0]!r}")
        model = q.get("model", "")
        problem = model_name_problem(model)
        if problem:
            raise BadRequest(f"model: {problem}", {"model": model})
        return json_response(route_choice(
            self.svc.config, model, self.svc.state_of, self._queue, self._queued,
            self.ensures.waiting >= self.ensures.total, self.peers()))

    async def usage(self, request: web.Request) -> web.Response:
        """Usage per key and model through the router (gpud.core.usage), from `since` (epoch
        seconds or ISO 8601; default: everything kept), of `key` alone when given."""
        q = request.query
        unknown = set(q) - {"since", "key"}
        if unknown:
            raise BadRequest(f"unknown query parameter {sorted(unknown)[0]!r}")
        since = hour_of(parse_since(q["since"])) if "since" in q else 0
        rows = await asyncio.to_thread(self.svc.store.usage, since, q.get("key"))
        states = await asyncio.to_thread(self.budgets) if self.budgets is not None else []
        answer: answers.Usage = {"since": since, "rows": [
            cast(answers.UsageRow, s.to_json()) for s in summarize(rows)], "budgets": [
            cast(answers.UsageBudget, b.to_json()) for b in states
            if q.get("key") in (None, b.key)]}
        return json_response(answer)

    async def _follow(self, request: web.Request, query: EventQuery) -> web.StreamResponse:
        """NDJSON: the matching backlog (up to `limit`), then each new event as it happens."""
        sub = self.svc.subscribe(query)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        try:
            last = 0
            for ev in await self.svc.events(query):
                last = ev.id or last
                await resp.write(json.dumps(ev.to_json()).encode() + b"\n")
            while True:
                try:
                    item: Event | None = await asyncio.wait_for(sub.queue.get(), timeout=15)
                except TimeoutError:
                    await resp.write(b"\n")  # keepalive: notices a client that went away
                    continue
                if item is None:
                    break
                if item.id is not None and item.id <= last:
                    continue
                await resp.write(json.dumps(item.to_json()).encode() + b"\n")
        except ConnectionResetError:
            pass  # the follower went away; a cancellation goes on up (gpud is stopping)
        finally:
            self.svc.unsubscribe(sub)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    async def openapi(self, request: web.Request) -> web.Response:
        from gpud.server.openapi import document

        return json_response(document())

    async def metrics_text(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            raise Unavailable("metrics are not set up in this gpud")
        # the exposition format's version is part of the content type Prometheus negotiates
        return web.Response(body=self.metrics().encode(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE,
                                     "X-Content-Type-Options": "nosniff"})

    # ---- mutations -------------------------------------------------------------------------

    @staticmethod
    def _uid(request: web.Request) -> int | None:
        peer: Credentials | None = request.get("peer")
        return peer.uid if peer else None

    async def admit(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        check_serve_name(name)
        body = await read_model(request, AdmitBody)
        if body.preempt:
            return await self._admit_preempting(name, body, self._uid(request))
        hint = (contextlib.nullcontext() if self.supervisor is None
                else self.supervisor.sleeps.preemption.preemption_hint(name, body.mib))
        with hint:
            admission = await self.svc.admit(name, body.mib, role=body.role,
                                             uid=self._uid(request))
        f = admission.figures
        res = admission.reservation
        answer: answers.Admitted = {
            "serve": name,
            "role": res.role,
            "mib": res.mib,
            "replaced_mib": admission.replaced_mib,
            "check": admission.check,
            "note": admission.note,
            "figures": figures_view(f),
        }
        by_role = {g.role: g for g in admission.all_figures}
        figures_of_each_role(answer, res, by_role.__getitem__)
        return json_response(answer)

    async def _admit_preempting(self, name: str, body: AdmitBody, uid: int | None) -> web.Response:
        if self.svc.serve_spec(name) is None:
            held = self.svc.ledger.reservations.get(name)
            what = "holds an external reservation" if held is not None and held.external \
                else "is not in the config"
            raise BadRequest(f"serve {name!r} {what}: a preemption makes room only for a serve "
                             "gpud launches (admit without preempt to reserve memory for a "
                             "process gpud does not launch)", {"serve": name})
        if body.role is not None:
            self.svc.serve_role(name, body.role)  # the same check as a plain admission
        sup = self._need_supervisor()
        carried = await sup.sleeps.preemption.admit_preempting(name, body.mib, uid, dry_run=body.dry_run)
        if body.dry_run:
            return json_response({"serve": name, **carried})
        res = self.svc.ledger.reservations[name]
        answer: answers.Admitted = {
            "serve": name, "role": res.role, "mib": res.mib, "replaced_mib": None,
            "check": self.svc.config.daemon.admission, "note": None,
            "figures": figures_view(self.svc.ledger.figures(res.role)),
            "preemption": carried.get("preemption"),
        }
        figures_of_each_role(answer, res, self.svc.ledger.figures)
        return json_response(answer)

    async def sleep(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        check_serve_name(name)
        body = await read_model(request, SleepBody, empty_ok=True)
        sup = self._need_supervisor()
        done = await sup.sleeps.sleep(name, self._uid(request), body.level)
        return json_response({**self._serve_view(name), "sleep": done})

    async def wake(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        check_serve_name(name)
        await read_model(request, EmptyBody, empty_ok=True)
        sup = self._need_supervisor()
        done = await sup.sleeps.wake(name, self._uid(request))
        return json_response({**self._serve_view(name), "wake": done})

    async def release(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        check_serve_name(name)
        body = await read_model(request, ReleaseBody, empty_ok=True)
        uid = self._uid(request)
        held = self.svc.ledger.reservations.get(name)
        if body.stop and self.supervisor is not None and self.svc.serve_spec(name) is not None:
            # Checked before the stop: a serve that holds nothing is not stopped by a release.
            if held is None:
                raise Conflict(f"serve {name!r} holds no reservation", {"serve": name})
            await self.supervisor.stop(name, uid)
            res = held
        else:  # nothing of gpud's to stop (or no supervisor): the plain, guarded release
            res = await self.svc.release(name, uid=uid)
        f = self.svc.ledger.figures(res.role)
        answer: answers.Released = {
            "serve": name, "role": res.role, "released_mib": res.mib, "figures": figures_view(f),
        }
        figures_of_each_role(answer, res, self.svc.ledger.figures)
        return json_response(answer)

    def _need_supervisor(self) -> Supervisor:
        if self.supervisor is None:
            _, why = self.svc.launching()
            raise Unavailable(f"launching is unavailable: {why}")
        return self.supervisor

    async def _lifecycle(self, request: web.Request, action: str) -> web.Response:
        name = request.match_info["name"]
        check_serve_name(name)
        body = await read_model(request, StartBody if action == "start" else EmptyBody,
                                empty_ok=True)
        sup = self._need_supervisor()
        uid = self._uid(request)
        if isinstance(body, StartBody) and body.preempt and body.dry_run:
            spec = self.svc.serve_spec(name)
            if spec is None:
                raise NotFound(f"unknown serve {name!r}: not in the config", {"serve": name})
            plan = await sup.sleeps.preemption.admit_preempting(name, spec.vram_mib, uid, dry_run=True)
            return json_response({**self._serve_view(name), **plan})
        if action != "stop" and self.on_demand is not None:
            # An operator's start overrides an on-demand serve's backoff, and starts it over.
            self.on_demand.operator_started(name)
        if isinstance(body, StartBody):
            carried = await sup.launch_job.start(name, uid, preempt=body.preempt)
            if body.preempt:
                return json_response({**self._serve_view(name),
                                      "preemption": (carried or {}).get("preemption")})
        elif action == "stop":
            await sup.stop(name, uid)
        else:
            await sup.restart(name, uid)
        return json_response(self._serve_view(name))

    async def start(self, request: web.Request) -> web.Response:
        return await self._lifecycle(request, "start")

    async def ensure(self, request: web.Request) -> web.Response:
        """The front's check before each request to an on-demand serve (gpud.server.ondemand)."""
        name = request.match_info["name"]
        check_serve_name(name)
        await read_model(request, EmptyBody, empty_ok=True)
        if self.on_demand is None:
            raise Unavailable("on-demand serves are not set up in this gpud")
        cause = router_request(request.headers)
        requester = cause.requester if cause is not None else ANONYMOUS
        if self.svc.state_of(name) == ServeState.RUNNING and not self.on_demand.settling(name):
            # up: answered at once (gpud.life.ondemand), never refused by the bound on the requests
            # that wait for a bring-up, whoever else waits
            return await self.on_demand.ensure(name, cause, gone=_gone(request))
        d, bound = self.svc.config.daemon, self.ensures
        bound.per_requester, bound.total = (d.ensure_waiting_per_requester,
                                            d.ensure_waiting_total)
        problem = bound.enter(requester)
        if problem is not None:
            return too_many_waiting(name, requester, problem, BUSY_RETRY_S)
        try:
            return await self.on_demand.ensure(name, cause, gone=_gone(request))
        finally:
            # answered, or its client (nginx's ensure) gone: OnDemand.ensure returns then (gone)
            bound.leave(requester)

    async def stop(self, request: web.Request) -> web.Response:
        return await self._lifecycle(request, "stop")

    async def restart(self, request: web.Request) -> web.Response:
        return await self._lifecycle(request, "restart")

    def _calibrator(self) -> Calibrations:
        if self.calibrations is None:
            raise Unavailable("calibration is not set up in this gpud")
        return self.calibrations

    async def calibration(self, request: web.Request) -> web.Response:
        name = self._known(request)
        return json_response(self._calibrator().view(name))

    async def calibrate(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        check_serve_name(name)
        body = await read_model(request, CalibrateBody, empty_ok=True)
        return json_response(self._calibrator().start(name, body.window_s, self._uid(request)))

    def _rebalancer(self) -> Rebalancer:
        if self.rebalancer is None:
            raise Unavailable("rebalancing is not set up in this gpud")
        return self.rebalancer

    async def plan(self, request: web.Request) -> web.Response:
        rebalancer = self._rebalancer()
        # The peer's slot is taken before its body is read: one request too many costs nothing.
        async with self.offload.slot(self._uid(request), "plan"):
            body = await read_model(request, ConfigBody, limit=CONFIG_BODY_LIMIT)
            text = await rebalancer.plan_json(body.config, body.source or "(request)")
        return web.Response(text=text, content_type="application/json")

    async def apply(self, request: web.Request) -> web.StreamResponse:
        """NDJSON: one line per step as it happens, then the result line."""
        rebalancer = self._rebalancer()
        uid = self._uid(request)
        async with self.offload.slot(uid, "apply"):
            body = await read_model(request, ConfigBody, limit=CONFIG_BODY_LIMIT)
            source = body.source or "(request)"
            # Bad input (400), a change only root may make (403) and an apply that cannot
            # begin (409) are answered before anything streams.
            cfg = await self.offload.run(rebalancer.parse, body.config, source)
            if uid != 0:
                paths = await self.offload.run(needs_root, self.svc.config, cfg)
                if paths:
                    raise Forbidden(
                        f"uid {uid} may change figures only; this change needs root: "
                        f"{', '.join(paths[:20])}" + (" ..." if len(paths) > 20 else ""),
                        {"uid": uid, "needs_root": paths})
        rebalancer.check_can_begin()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)

        async def emit(line: answers.ApplyStep | answers.ApplyResult) -> None:
            with contextlib.suppress(ConnectionResetError):
                await resp.write(json.dumps(line).encode() + b"\n")

        result: answers.ApplyResult
        try:
            result = await rebalancer.apply(body.config, source, uid, emit, cfg)
        except GpudError as exc:
            result = {"result": ApplyOutcome.REFUSED, "error": exc.to_json()["error"]}
        except Exception as exc:  # the stream has begun: its last line says what went wrong
            log.exception("apply failed")
            result = {"result": ApplyOutcome.FAILED,
                      "error": GpudError(f"apply failed: {exc}").to_json()["error"]}
        await emit(result)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    async def reload(self, request: web.Request) -> web.Response:
        uid = self._uid(request)
        async with self.offload.slot(uid, "reload"):
            await read_model(request, EmptyBody, empty_ok=True)
            if self.reload_hook is None:
                raise Unavailable("this gpud was started without a config file to reload")
            return json_response(await self.reload_hook(uid))


_FRONT_UIDS: dict[str, int] = {}


def _uid_of(user: str) -> int | None:
    """The front user's uid, looked up once per name: every request to an on-demand serve
    asks, and a read of the passwd database each time would add to its latency. A user not
    found is asked again (the package may create it after gpud started)."""
    if user not in _FRONT_UIDS:
        try:
            _FRONT_UIDS[user] = pwd.getpwnam(user).pw_uid
        except KeyError:
            return None
    return _FRONT_UIDS[user]


# Retry-After of an ensure refused for the requests waiting already (daemon.ensure_waiting_*).
BUSY_RETRY_S = 5


def _gone(request: web.Request) -> asyncio.Future[None] | None:
    """Done once the asker's connection is lost (gpud.server.connguard.Guarded), None when unknown."""
    transport = request.transport
    guard = transport.get_protocol() if transport is not None else None
    return guard.lost() if isinstance(guard, Guarded) else None
