"""gpud.core.peers: what a peer's answer means, its circuit, which host takes a request, one
list of every host's models. Pure: tables and properties."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpud.core.peers import (
    MAX_MODELS,
    MAX_MODELS_BYTES,
    PROBE_PATH,
    TRANSITIONS,
    VIA_FIELD,
    Circuit,
    CircuitAction,
    CircuitEvent,
    CircuitState,
    HostModel,
    IPAccess,
    MergedModel,
    ModelsProblem,
    Offer,
    PeerModel,
    PeerOutcome,
    admits,
    choose_host,
    classify,
    event_of,
    gpud_error_code,
    ip_access,
    listing_entry,
    local_offer,
    may_send,
    merge,
    offered,
    offers_of,
    parse_models,
    peer_offer,
    step,
    url_problem,
)
from tests.conftest import REPO

C, OPEN, H = CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN


# --- the url -------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://node2.tailnet:8000", "https://node2.tailnet:8443/",
                                 "http://10.0.0.2:8000", "http://[fd7a:115c::2]:8000/",
                                 "https://node2", "http://localhost:1"])
def test_good_urls(url: str) -> None:
    assert url_problem(url) is None


@pytest.mark.parametrize("url", ["node2:8000", "http://", "http://node2:0", "http://node2:x",
                                 "http://node2:8000/v1", "http://node2:8000//", "http://a@b:1",
                                 "http://node2:8000#x", "http://node2:8000?", "unix:///x",
                                 "http://[::1:8000", "http://[zz]:1", "http://node2:\uff18\uff10",
                                 "http://-node2:1", "http://no\x00de:1", "gopher://node2:70"])
def test_bad_urls_are_named(url: str) -> None:
    problem = url_problem(url)
    assert problem is not None and repr(url) in problem


@given(st.text(max_size=60))
def test_a_url_without_a_problem_is_http_and_has_no_path(url: str) -> None:
    if url_problem(url) is None:
        assert url.startswith(("http://", "https://"))
        rest = url.split("://", 1)[1]
        assert "/" not in rest.rstrip("/") and not any(c in rest for c in "?#@ ")


# --- what an answer means ------------------------------------------------------------------

def gpud_doc(code: str) -> bytes:
    return json.dumps({"error": {"message": "m", "type": "server_error", "param": None,
                                 "code": code}}).encode()


@pytest.mark.parametrize(("status", "body", "outcome"), [
    (200, b'{"object": "list", "data": []}', PeerOutcome.OK),
    # the peer's gpud refused (no memory, queue full, rate limited, model not found): answers
    (503, gpud_doc("model_unavailable"), PeerOutcome.ANSWER),
    (429, gpud_doc("rate_limit_exceeded"), PeerOutcome.ANSWER),
    (404, gpud_doc("model_not_found"), PeerOutcome.ANSWER),
    (503, gpud_doc("model_not_running"), PeerOutcome.ANSWER),
    # gpud's own API error shape (gpud.core.answers.Error), passed on by the router
    (503, json.dumps({"error": {"code": "too-many-requests", "message": "m",
                                "details": {}}}).encode(), PeerOutcome.ANSWER),
    # a 5xx the peer's gpud did not write: a proxy's page, vLLM's integer code, nothing
    (502, b"<html><body>502 Bad Gateway</body></html>", PeerOutcome.FAILURE),
    (500, json.dumps({"error": {"message": "m", "type": "x", "code": 500}}).encode(),
     PeerOutcome.FAILURE),
    (504, b"", PeerOutcome.FAILURE),
    (503, b'{"error": "down"}', PeerOutcome.FAILURE),
    (503, b'{"error": {"code": "x"}}', PeerOutcome.FAILURE),
    (302, b"", PeerOutcome.FAILURE),
    (400, b"bad", PeerOutcome.ANSWER),
])
def test_classify(status: int, body: bytes, outcome: PeerOutcome) -> None:
    assert classify(status, body) == outcome


def test_every_code_the_router_writes_is_known_as_gpuds_shape() -> None:
    # the router's fail() and its error tables: each code, in its document, is an answer
    import re

    text = (REPO / "gpud" / "data" / "router.js").read_text()
    codes = set(re.findall(r"code: '([a-z_]+)'", text)) | set(
        re.findall(r"\[\d{3}, [^\]]*, '([a-z_]+)'\]", text, re.DOTALL))
    assert {"rate_limit_exceeded", "model_unavailable", "model_not_running"} <= codes
    for code in codes:
        assert gpud_error_code(gpud_doc(code)) == code
        assert classify(503, gpud_doc(code)) == PeerOutcome.ANSWER


@given(st.integers(500, 599), st.binary(max_size=200))
def test_a_5xx_is_a_failure_unless_it_is_a_gpud_error_document(status: int, body: bytes) -> None:
    assert (classify(status, body) == PeerOutcome.FAILURE) == (gpud_error_code(body) is None)


# --- the circuit ---------------------------------------------------------------------------

CIRCUIT_TABLE = [
    (C, CircuitEvent.OK, C, ()),
    (C, CircuitEvent.ANSWER, C, ()),
    (C, CircuitEvent.FAILURE, OPEN, (CircuitAction.JOURNAL_OPENED, CircuitAction.PROBE)),
    (C, CircuitEvent.PROBE_DUE, C, ()),
    (OPEN, CircuitEvent.OK, C, (CircuitAction.JOURNAL_CLOSED,)),
    (OPEN, CircuitEvent.ANSWER, C, (CircuitAction.JOURNAL_CLOSED,)),
    (OPEN, CircuitEvent.FAILURE, OPEN, ()),
    (OPEN, CircuitEvent.PROBE_DUE, H, (CircuitAction.PROBE,)),
    (H, CircuitEvent.OK, C, (CircuitAction.JOURNAL_CLOSED,)),
    (H, CircuitEvent.ANSWER, C, (CircuitAction.JOURNAL_CLOSED,)),
    (H, CircuitEvent.FAILURE, OPEN, ()),
    (H, CircuitEvent.PROBE_DUE, H, ()),
]


@pytest.mark.parametrize(("state", "event", "after", "actions"), CIRCUIT_TABLE)
def test_circuit_table(state: CircuitState, event: CircuitEvent, after: CircuitState,
                       actions: tuple[CircuitAction, ...]) -> None:
    circuit, done = step(Circuit(state, 1.0, "was" if state != C else None), event, 7.0, "why")
    assert (circuit.state, done) == (after, actions)
    assert circuit.since == (7.0 if after != state else 1.0)
    assert (circuit.reason is None) == (after == C)


def test_the_table_covers_every_state_and_event() -> None:
    assert set(TRANSITIONS) == {(s, e) for s in CircuitState for e in CircuitEvent}
    assert len(CIRCUIT_TABLE) == len(TRANSITIONS)


def test_a_typed_answer_never_opens_the_circuit() -> None:
    # a memory denial on the peer is an answer: the circuit stays closed
    circuit, actions = step(Circuit(), CircuitEvent.ANSWER, 1.0)
    assert circuit.state == C and actions == ()


@given(st.lists(st.sampled_from(list(CircuitEvent)), max_size=40))
def test_journal_lines_alternate_and_match_the_state(events: list[CircuitEvent]) -> None:
    circuit, journal = Circuit(), []
    for i, event in enumerate(events):
        circuit, actions = step(circuit, event, float(i), "r")
        journal += [a for a in actions if a != CircuitAction.PROBE]
        # while not closed, only the probe's route may be asked of the peer
        assert may_send(circuit, "/v1/chat/completions") == (circuit.state == C)
        assert may_send(circuit, PROBE_PATH)
    # opened and closed alternate, opened first; one line for each change, never more
    assert journal == [CircuitAction.JOURNAL_OPENED, CircuitAction.JOURNAL_CLOSED][
        :len(journal)] * (len(journal) // 2) + ([CircuitAction.JOURNAL_OPENED]
                                                 if len(journal) % 2 else [])
    assert (circuit.state == C) == (len(journal) % 2 == 0)


# --- the model lists -----------------------------------------------------------------------

def models_doc(*entries: dict[str, object]) -> bytes:
    return json.dumps({"object": "list", "data": list(entries)}).encode()


def test_parse_a_routers_models() -> None:
    body = models_doc(
        {"id": "chat", "object": "model", "owned_by": "gpud",
         "gpud": {"serve": "chat", "state": "running"}},
        {"id": "ocr", "object": "model", "gpud": {
            "serve": "ocr", "state": "stopped", "expected_wait_s": 42.5,
            "queue": [{"requester": "a", "position": 1, "waiting": 2},
                      {"requester": "b", "position": 2, "waiting": 1}]}},
        {"id": "far", "object": "model", "gpud": {"state": "running", VIA_FIELD: "node3"}},
        {"id": "odd", "gpud": {"state": "dancing", "expected_wait_s": -1}})
    assert parse_models(body) == (PeerModel("chat", "running"),
                                  PeerModel("ocr", "stopped", 42.5, 3),
                                  PeerModel("odd", "unknown"))


@pytest.mark.parametrize(("body", "why"), [
    (b"<html>", "answer not JSON"),
    (b"\xff\xfe", "answer not UTF-8"),
    (b"[1, 2]", "no `data` array"),
    (b'{"data": {}}', "no `data` array"),
    (b'{"data": [{"id": 3}]}', "data[0] is not a model"),
    (b"[" * 100_000, "nested too deeply"),
    (b" " * (MAX_MODELS_BYTES + 1), f"answer over {MAX_MODELS_BYTES} bytes"),
    (models_doc(*({"id": f"m{i}"} for i in range(MAX_MODELS + 1))),
     f"lists {MAX_MODELS + 1} models"),
])
def test_garbage_is_named(body: bytes, why: str) -> None:
    with pytest.raises(ModelsProblem, match=why.replace("[", r"\[").replace("`", ".")):
        parse_models(body)


@given(st.binary(max_size=300))
def test_parse_models_either_answers_or_names_the_problem(body: bytes) -> None:
    try:
        parse_models(body)
    except ModelsProblem as exc:
        assert str(exc)


def test_offered_keeps_only_the_models_named() -> None:
    ms = (PeerModel("a"), PeerModel("b"), PeerModel("c"))
    assert offered(ms, None) == ms
    assert offered(ms, ["c", "a", "zz"]) == (PeerModel("a"), PeerModel("c"))


def test_merge_lists_a_model_once_with_its_hosts() -> None:
    merged = merge([PeerModel("chat", "running")],
                   {"node3": [PeerModel("chat", "sleeping"), PeerModel("big")],
                    "node2": [PeerModel("chat", "stopped"), PeerModel("ocr")]})
    assert [(m.id, [h.host for h in m.hosts]) for m in merged] == [
        ("big", ["node3"]), ("chat", [None, "node2", "node3"]), ("ocr", ["node2"])]
    entries = {m.id: listing_entry(m) for m in merged}
    assert entries["chat"] == {"hosts": ["", "node2", "node3"]}
    assert entries["ocr"] == {"hosts": ["node2"], VIA_FIELD: "node2"}


def test_a_loop_of_two_hosts_never_offers_a_model_back() -> None:
    # A lists B's models; B reads A's list: what A offers only from B is marked, and left out
    a_list = merge([PeerModel("a-model")], {"b": [PeerModel("b-model")]})
    body = models_doc(*({"id": m.id, "gpud": listing_entry(m) | {"state": "running"}}
                        for m in a_list))
    assert [m.id for m in parse_models(body)] == ["a-model"]


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]),
                          st.sampled_from([None, "p1", "p2"])), max_size=20))
def test_merge_keeps_every_pair_once(pairs: list[tuple[str, str | None]]) -> None:
    local = [PeerModel(m) for m, h in pairs if h is None]
    peers = {p: [PeerModel(m) for m, h in pairs if h == p] for p in ("p1", "p2")}
    merged = merge(local, peers)
    ids = [m.id for m in merged]
    assert ids == sorted(set(ids)) and set(ids) == {m for m, _ in pairs}
    for m in merged:
        hosts = [h.host for h in m.hosts]
        assert hosts == sorted(set(hosts), key=lambda h: (h is not None, h or ""))


# --- which host ----------------------------------------------------------------------------

def test_awake_first_then_the_smallest_wait_this_host_on_a_tie() -> None:
    here = Offer(None, awake=False, expected_wait_s=30.0)
    p1 = Offer("p1", awake=True)
    p2 = Offer("p2", awake=False, expected_wait_s=10.0)
    assert choose_host([here, p1, p2]) == p1
    assert choose_host([here, p2]) == here                    # no spillover: stays here
    assert choose_host([here, p2], spillover=True) == p2      # a shorter wait there
    assert choose_host([Offer(None, False, expected_wait_s=10.0), p2], spillover=True).host is None
    assert choose_host([Offer(None, True), p1], spillover=True).host is None
    assert choose_host([p2, Offer("p0", False, expected_wait_s=10.0)]).host == "p0"
    assert choose_host([]) is None


def test_spillover_leaves_a_full_queue_here() -> None:
    here = Offer(None, awake=True, saturated=True, queue_full=True, expected_wait_s=1.0)
    peer = Offer("p1", awake=False, expected_wait_s=60.0)
    assert choose_host([here, peer]) == here
    assert choose_host([here, peer], spillover=True) == peer
    # a full queue everywhere: this host answers (its queue refuses with its reason)
    assert choose_host([here, Offer("p1", True, True, True)], spillover=True) == here


def test_the_offers_as_each_host_reports_them() -> None:
    """What GET /v1/route compares: this host's serve (its state, its queue for a bring-up,
    whether its queue is full, its expected wait) and each peer's /v1/models entry."""
    assert local_offer("running", 0, False, None) == Offer(None, awake=True)
    assert local_offer("running", 0, True, None) == Offer(None, True, True, True)
    assert local_offer("sleeping", 2, False, 12.0) == Offer(None, False, True, False, 12.0)
    assert peer_offer("b", PeerModel("m", "running")) == Offer("b", awake=True)
    assert peer_offer("b", PeerModel("m", "stopped", 40.0, 3)) == Offer("b", False, True,
                                                                      False, 40.0)
    here = local_offer("sleeping", 1, False, 30.0)
    peers = {"c": PeerModel("m", "sleeping", 5.0), "b": PeerModel("m", "running")}
    assert [o.host for o in offers_of(here, peers)] == [None, "b", "c"]
    # awake on b beats a bring-up here; with spillover the shorter wait on c beats 30 s here
    assert choose_host(offers_of(here, peers)).host == "b"
    assert choose_host(offers_of(here, {"c": peers["c"]}), spillover=True).host == "c"
    assert choose_host(offers_of(here, {"c": peers["c"]})).host is None
    assert choose_host(offers_of(None, {})) is None


offers = st.builds(Offer, st.sampled_from([None, "p1", "p2", "p3"]), st.booleans(),
                   st.booleans(), st.booleans(),
                   st.one_of(st.none(), st.floats(0, 1000, allow_nan=False)))


@given(st.lists(offers, min_size=1, max_size=6, unique_by=lambda o: o.host), st.booleans())
def test_choose_host_properties(given_offers: list[Offer], spillover: bool) -> None:
    chosen = choose_host(given_offers, spillover=spillover)
    assert chosen in given_offers
    local = next((o for o in given_offers if o.host is None), None)
    ready_peers = [o for o in given_offers if o.host and o.ready and not o.queue_full]
    # a host where it is ready wins over one where it is not
    if chosen is not None and not chosen.ready:
        assert not ready_peers and not (local and local.ready and not local.queue_full)
    # ready here: never sent away
    if local is not None and local.ready and not local.queue_full:
        assert chosen == local
    # without spillover, a peer only when it is ready there and not here
    if local is not None and not spillover and chosen != local:
        assert chosen is not None and chosen.ready and not local.ready
    # never a peer whose queue is full, unless every host's is
    if chosen is not None and chosen.host is not None and chosen.queue_full:
        assert all(o.queue_full for o in given_offers if o.host is not None) and (
            local is None)


def test_the_core_module_has_no_io() -> None:
    source = Path(REPO / "gpud" / "core" / "peers.py").read_text()
    assert "import asyncio" not in source and "aiohttp" not in source


# --- a unit's IP access lists (systemd.resource-control(5)) ---------------------------------

def test_ip_access_reads_the_service_sections_lists_in_order() -> None:
    unit = ("# IPAddressAllow=any\n; IPAddressDeny=any\n\n[Unit]\nIPAddressAllow=any\n"
            "[Service]\nIPAddressDeny=any\nIPAddressAllow=localhost 10.0.0.0/8\n"
            "  IPAddressAllow = 192.168.1.7\nOther=x\nnot an assignment\n")
    assert ip_access([unit]) == IPAccess(("localhost", "10.0.0.0/8", "192.168.1.7"), ("any",))
    # a drop-in's empty assignment resets the list; a later one adds again
    dropin = "[Service]\nIPAddressAllow=\nIPAddressAllow=100.64.0.0/10\n"
    assert ip_access([unit, dropin]) == IPAccess(("100.64.0.0/10",), ("any",))
    assert ip_access([unit, "[Service]\nIPAddressDeny=  \n"]).deny == ()
    # a section opened later ends the [Service] one
    assert ip_access(["[Service]\n[Install]\nIPAddressDeny=any\n"]) == IPAccess()
    assert ip_access([]) == IPAccess()
    # each file starts in no section; a value that ends in "]" opens none
    assert ip_access(["[Service]\nIPAddressDeny=any\n", "IPAddressDeny=10.0.0.0/8\n"]) == (
        IPAccess((), ("any",)))
    assert ip_access(["[Service]\nEnvironment=LIST=[a]\nIPAddressDeny=any\n"]) == (
        IPAccess((), ("any",)))


def test_an_address_is_granted_by_allow_else_denied_by_deny_else_granted() -> None:
    shipped = IPAccess(allow=("localhost",), deny=("any",))
    assert admits(shipped, "127.0.0.1") and admits(shipped, "::1")
    assert not admits(shipped, "100.64.0.2") and not admits(shipped, "fd00::2")
    tailnet = IPAccess(allow=("localhost", "100.64.0.0/10"), deny=("any",))
    assert admits(tailnet, "100.64.0.2") and not admits(tailnet, "100.128.0.1")
    assert admits(IPAccess(), "203.0.113.9")
    assert admits(IPAccess(deny=("10.0.0.0/8",)), "203.0.113.9")
    assert not admits(IPAccess(deny=("10.0.0.0/8",)), "10.1.2.3")
    # an entry systemd refuses matches nothing; a v4 network never matches a v6 address
    assert admits(IPAccess(deny=("not-a-network", "0.0.0.0/0")), "::1")
    assert not admits(IPAccess(allow=("garbage",), deny=("::/0",)), "::1")
    assert admits(IPAccess(allow=("link-local",), deny=("any",)), "fe80::1")
    assert not admits(IPAccess(allow=("multicast",), deny=("any",)), "fe80::1")
    assert admits(IPAccess(allow=("multicast",), deny=("any",)), "224.0.0.1")


# --- the edges -----------------------------------------------------------------------------

@pytest.mark.parametrize(("url", "says"), [
    ("http://no de:80", "must not contain spaces or control characters"),
    ("http://node\x00:80", "must not contain spaces or control characters"),
    ("http://node\x7f:80", "must not contain spaces or control characters"),
    ("http://node/!", "must have no path beyond '/'"),
    ("http://user@node:80", "must not carry a user or password"),
    ("http://[::1]x80", "'[::1]x80' is not HOST:PORT"),
    ("http://[::1]:0", "the port '0' is not 1-65535"),
    ("http://[::1]:", "the port '' is not 1-65535"),
    ("http://:80", "names no host"),
    ("http://node:65536", "the port '65536' is not 1-65535"),
    ("http://node/v1", "must have no path beyond '/'"),
    ("http://node/?q=1", "must have no query or fragment"),
    ("http://node#f", "must have no query or fragment"),
])
def test_each_problem_of_a_url_is_named(url: str, says: str) -> None:
    problem = url_problem(url)
    assert problem is not None and says in problem, problem


def test_the_edges_of_a_good_url() -> None:
    for url in ("http://node:65535", "http://node:1", "http://[::1]", "http://[::1]:65535/"):
        assert url_problem(url) is None, url


@pytest.mark.parametrize(("status", "outcome"), [
    (199, PeerOutcome.ANSWER), (200, PeerOutcome.OK), (299, PeerOutcome.OK),
    (300, PeerOutcome.FAILURE), (399, PeerOutcome.FAILURE), (400, PeerOutcome.ANSWER),
    (499, PeerOutcome.ANSWER), (500, PeerOutcome.FAILURE)])
def test_the_edges_of_each_class_of_status(status: int, outcome: PeerOutcome) -> None:
    assert classify(status, b"<html>bad gateway</html>") == outcome


def test_gpuds_error_code_is_read_from_its_document() -> None:
    doc = {"error": {"message": "no memory", "type": "x", "code": "no_memory"}}
    assert gpud_error_code(json.dumps(doc).encode()) == "no_memory"


def test_each_outcome_is_its_circuits_event() -> None:
    assert [event_of(o) for o in PeerOutcome] == [
        CircuitEvent.OK, CircuitEvent.ANSWER, CircuitEvent.FAILURE]


def test_an_open_circuit_keeps_the_latest_failures_reason() -> None:
    opened, _ = step(Circuit(), CircuitEvent.FAILURE, 10.0, "refused")
    assert opened == Circuit(OPEN, 10.0, "refused")
    again, actions = step(opened, CircuitEvent.FAILURE, 20.0, "timed out")
    assert again == Circuit(OPEN, 10.0, "timed out") and actions == ()
    # a failure that says nothing keeps what it had; a closed circuit keeps no reason
    assert step(again, CircuitEvent.FAILURE, 30.0)[0] == again
    assert step(Circuit(), CircuitEvent.OK, 5.0, "ignored")[0] == Circuit()
    half, _ = step(again, CircuitEvent.PROBE_DUE, 40.0, "probe")
    assert step(half, CircuitEvent.PROBE_DUE, 41.0, "other")[0] == half


def models_body(n: int, pad_to: int | None = None) -> bytes:
    body = json.dumps({"data": [{"id": f"m{i}"} for i in range(n)]}).encode()
    return body if pad_to is None else body + b" " * (pad_to - len(body))


def test_the_bounds_of_an_answer_are_inclusive() -> None:
    mib = 1048576  # 1 MiB, written out: the constant is what a mutant changes
    assert len(parse_models(models_body(1, pad_to=mib))) == 1
    with pytest.raises(ModelsProblem, match="answer over"):
        parse_models(models_body(1, pad_to=mib + 1))
    assert len(parse_models(models_body(4096))) == 4096
    with pytest.raises(ModelsProblem, match="lists 4097 models, over"):
        parse_models(models_body(4097))


def test_what_a_model_entry_says_that_is_not_its_shape_is_ignored() -> None:
    body = json.dumps({"data": [
        {"id": "a", "gpud": "not an object"},
        {"id": "b", "gpud": {"state": "sleeping", "expected_wait_s": 0,
                             "queue": [{"waiting": 2}, {"waiting": "3"}, 5, {"other": 1},
                                       {"waiting": 1}]}},
        {"id": "c", "gpud": {"expected_wait_s": 0.5}}]}).encode()
    assert parse_models(body) == (PeerModel("a"), PeerModel("b", "sleeping", 0.0, 3),
                                  PeerModel("c", "unknown", 0.5))


def test_a_model_only_peers_serve_names_the_first_as_via() -> None:
    merged = MergedModel("m", (HostModel("a", PeerModel("m")), HostModel("b", PeerModel("m"))))
    assert listing_entry(merged) == {"hosts": ["a", "b"], VIA_FIELD: "a"}


def test_one_request_waiting_makes_a_host_saturated() -> None:
    assert peer_offer("b", PeerModel("m", "running", None, 1)).saturated
    assert local_offer("running", 1, False, None).saturated


def test_ready_beats_a_wait_of_zero_and_several_ready_peers_go_by_name() -> None:
    ready_b = Offer("b", awake=True)
    assert choose_host([Offer("a", awake=False, expected_wait_s=0.0), ready_b],
                       spillover=True) == ready_b
    here = Offer(None, awake=False, expected_wait_s=1.0)
    assert choose_host([here, Offer("c", True), Offer("b", True)]).host == "b"
    # every peer's queue full and no serve here: the best of them all the same
    full_a = Offer("a", awake=True, saturated=True, queue_full=True, expected_wait_s=9.0)
    full_b = Offer("b", awake=True, saturated=True, queue_full=True, expected_wait_s=1.0)
    assert choose_host([full_a, full_b]) == full_b
