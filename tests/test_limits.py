"""The keys' limits as the router's nginx lines (gpud.core.limits): a zone per limited key,
keyed by its name alone, a routed location's counts before the body and its rates after, and
a requester's large bodies. What nginx does with them is proven against the real nginx in
tests/test_router_keys.py; here, which lines each key and setting makes."""

from __future__ import annotations

from gpud.core.keys import ApiKey
from gpud.core.limits import (
    BODIES_ZONE,
    FRONT_RATE_STATUS,
    QUOTA_STATUS,
    conn_lines,
    limit_lines,
    limit_zones,
)
from gpud.core.nginxblocks import REQUESTER_ADDR

PLAIN = ApiKey("plain", "0" * 64, ("*",))
BOTH = ApiKey("alice", "1" * 64, ("*",), max_concurrent=2, requests_per_minute=60)
COUNT = ApiKey("bob", "2" * 64, ("*",), max_concurrent=5)
RATE = ApiKey("carol", "3" * 64, ("*",), requests_per_minute=1)


def test_a_key_without_limits_has_no_zone_and_the_others_keep_their_place() -> None:
    assert limit_zones([PLAIN]) == []
    assert limit_zones([PLAIN, BOTH, COUNT, RATE]) == [
        # index 1: the key's place among all keys, so a key's zone keeps its name when
        # another key gains or loses its limits
        "    map $router_key_name $router_limit_1 {",
        '        "alice" "alice";',
        '        default "";',
        "    }",
        "    limit_conn_zone $router_limit_1 zone=router_conn_1:1m;",
        "    limit_req_zone $router_limit_1 zone=router_rpm_1:1m rate=60r/m;",
        "    map $router_key_name $router_limit_2 {",
        '        "bob" "bob";',
        '        default "";',
        "    }",
        "    limit_conn_zone $router_limit_2 zone=router_conn_2:1m;",
        "    map $router_key_name $router_limit_3 {",
        '        "carol" "carol";',
        '        default "";',
        "    }",
        "    limit_req_zone $router_limit_3 zone=router_rpm_3:1m rate=1r/m;",
    ]


def test_the_large_bodies_zone_counts_a_requesters_large_or_chunked_bodies() -> None:
    # a body under LARGE_BODY_BYTES (10^6) has at most 6 digits in its Content-Length
    assert limit_zones([], large_bodies=16) == [
        "    map $content_length$http_transfer_encoding $router_body_large {",
        '        "~^[0-9]{1,6}$" "";',
        '        "" "";',
        "        default 1;",
        "    }",
        "    map $router_key_name $router_requester_early {",
        f'        "" "addr:{REQUESTER_ADDR}";',
        "        default $router_key_name;",
        "    }",
        "    map $router_body_large $router_body_of {",
        '        "" "";',
        "        default $router_requester_early;",
        "    }",
        f"    limit_conn_zone $router_body_of zone={BODIES_ZONE}:1m;",
    ]
    assert limit_zones([], large_bodies=0) == []
    assert limit_zones([BOTH], large_bodies=1)[-1] == (
        f"    limit_conn_zone $router_body_of zone={BODIES_ZONE}:1m;")


def test_the_counts_of_a_routed_location() -> None:
    assert conn_lines([PLAIN, RATE]) == []
    assert conn_lines([PLAIN, BOTH, RATE, COUNT]) == [
        "            limit_conn router_conn_1 2;",
        "            limit_conn router_conn_3 5;",
        "            limit_conn_status 429;"]
    assert conn_lines([PLAIN], large_bodies=16, indent="  ") == [
        f"  limit_conn {BODIES_ZONE} 16;", "  limit_conn_status 429;"]
    assert conn_lines([COUNT], large_bodies=3) == [
        "            limit_conn router_conn_0 5;",
        f"            limit_conn {BODIES_ZONE} 3;",
        "            limit_conn_status 429;"]


def test_the_rates_of_a_routed_location_a_minutes_worth_at_once() -> None:
    assert limit_lines([PLAIN, COUNT]) == []
    assert limit_lines([PLAIN, BOTH, COUNT, RATE]) == [
        "            limit_req zone=router_rpm_1 burst=59 nodelay;",
        # one a minute: no burst (nginx refuses burst=0)
        "            limit_req zone=router_rpm_3 nodelay;",
        "            limit_req_status 429;"]
    two = ApiKey("dan", "4" * 64, ("*",), requests_per_minute=2)
    assert limit_lines([two], indent="", status=FRONT_RATE_STATUS) == [
        "limit_req zone=router_rpm_0 burst=1 nodelay;",
        f"limit_req_status {FRONT_RATE_STATUS};"]


def test_the_router_s_own_statuses_are_told_apart() -> None:
    # statuses nginx never answers itself, each made the router's 429 by its own error page:
    # nginx says which limit refused a request by its status alone
    assert len({FRONT_RATE_STATUS, QUOTA_STATUS, 429}) == 3
