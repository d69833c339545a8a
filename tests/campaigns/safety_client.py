"""The clients of the shared-endpoint safety campaign (test_shared_endpoint_safety.py), run
inside the sandbox as real unprivileged users: standard library only, one JSON line on stdout
when done.

    greedy SEED PORT TOKEN SECONDS   a user taking what they can, in a seeded order: requests
                                     parked on a slow bring-up, large bodies of small parts,
                                     keyless stalled bodies, forged X-Gpud-* headers and a
                                     nested/escaped `model`, malformed HTTP; every answer kept
    polite PORT TOKEN SECONDS        another user: /v1/models, a completion and a stream in
                                     turn, each timed; streams read to their end
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import sys
import threading
import time
from typing import Any

HOST = "127.0.0.1"


def answer(raw: bytes) -> dict[str, Any]:
    """A raw HTTP answer: its status, content type and error code (None: not an error
    document)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or not lines[0].startswith("HTTP/"):
        return {"status": 0, "type": None, "code": None, "raw": raw[:200].decode("latin-1")}
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
    code = None
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        code = json.loads(body)["error"]["code"]
    return {"status": int(lines[0].split()[1]), "type": headers.get("content-type"),
            "code": code, "retry_after": headers.get("retry-after")}


def raw_request(port: int, data: bytes, timeout: float = 30, stall_s: float = 0) -> dict[str, Any]:
    """Send DATA (then, with STALL_S, nothing more for that long) and read the answer."""
    began = time.monotonic()
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.sendall(data)
            got = b""
            sock.settimeout(timeout)
            while True:
                part = sock.recv(65536)
                if not part:
                    break
                got += part
                head, sep, body = got.partition(b"\r\n\r\n")
                if sep:
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), None)
                    if length is not None and len(body) >= length:
                        break
    except OSError as exc:
        return {"status": 0, "type": None, "code": None, "raw": f"{type(exc).__name__}: {exc}",
                "took_s": time.monotonic() - began}
    result = answer(got)
    result["took_s"] = round(time.monotonic() - began, 3)
    return result


def post(path: str, body: bytes, token: str | None, extra: bytes = b"") -> bytes:
    auth = b"Authorization: Bearer " + token.encode() + b"\r\n" if token else b""
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + auth
            + extra + b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def greedy(seed: int, port: int, token: str, seconds: float) -> dict[str, Any]:
    rnd = random.Random(seed)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def keep(kind: str, result: dict[str, Any]) -> None:
        with lock:
            results.append({"kind": kind, **result})

    def park() -> None:
        body = json.dumps({"model": "b", "prompt": "x", "max_tokens": 1}).encode()
        keep("park", raw_request(port, post("/v1/completions", body, token), timeout=seconds + 30))

    def large() -> None:
        part = b'{"role":"user","content":"x"},'
        body = (b'{"messages":[' + part * ((8 << 20) // len(part)) + b'{}],"model":"b"}')
        keep("large", raw_request(port, post("/v1/chat/completions", body, token)))

    def stalled() -> None:
        # keyless, a 50 MiB body announced, a few bytes sent
        data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 52428800\r\n\r\n"
                b'{"model": "b", ')
        keep("stalled", raw_request(port, data, timeout=10))

    def forged() -> None:
        # the key may use b only: a nested "chat" and an escaped top-level one, forged headers
        body = (b'{"metadata": {"model": "b"}, "mod\\u0065l": "chat", "prompt": "'
                + b"x " * (40 << 10) + b'"}')
        keep("forged", raw_request(port, post(
            "/v1/completions", body, token,
            b"X-Gpud-Key: polite\r\nX-Gpud-Requester: polite\r\nX-Gpud-Model: chat\r\n")))

    def malformed() -> None:
        data = rnd.choice([b"GARBAGE\r\n\r\n",
                           b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                           b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000
                           + b"\r\n\r\n"])
        keep("malformed", raw_request(port, data))

    parked = rnd.randint(40, 80)
    plan = [park] * parked + [large] * rnd.randint(2, 4) + [stalled] * rnd.randint(5, 10) + \
        [forged] * rnd.randint(2, 4) + [malformed] * rnd.randint(3, 6)
    rnd.shuffle(plan)
    threads = []
    for action in plan:
        thread = threading.Thread(target=action, daemon=True)
        thread.start()
        threads.append(thread)
        time.sleep(rnd.uniform(0, 0.05))
    deadline = time.monotonic() + seconds + 40
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        return {"planned": len(plan), "parked": parked, "results": list(results)}


def polite(port: int, token: str, seconds: float) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    calls: list[dict[str, Any]] = []
    end = time.monotonic() + seconds
    turn = 0
    while time.monotonic() < end:
        kind = ("models", "complete", "stream")[turn % 3]
        turn += 1
        began = time.monotonic()
        conn = http.client.HTTPConnection(HOST, port, timeout=60)
        try:
            if kind == "models":
                conn.request("GET", "/v1/models", headers=headers)
            else:
                conn.request("POST", "/v1/completions", headers=headers, body=json.dumps(
                    {"model": "chat", "prompt": "a b c", "max_tokens": 8,
                     "stream": kind == "stream"}))
            resp = conn.getresponse()
            body = resp.read().decode()
            call: dict[str, Any] = {"kind": kind, "status": resp.status,
                                    "took_s": round(time.monotonic() - began, 3)}
            if kind == "models" and resp.status == 200:
                call["states"] = {m["id"]: m["gpud"]["state"] for m in json.loads(body)["data"]}
            if kind == "stream":
                events = [e for e in body.split("\n\n") if e.strip()]
                call["done"] = bool(events) and events[-1] == "data: [DONE]"
                call["errors"] = [e for e in events if e.startswith("data: {\"error\"")]
        except (OSError, http.client.HTTPException) as exc:
            call = {"kind": kind, "status": 0, "error": f"{type(exc).__name__}: {exc}",
                    "took_s": round(time.monotonic() - began, 3)}
        finally:
            conn.close()
        calls.append(call)
        time.sleep(0.2)
    return {"calls": calls}


def main() -> int:
    what, args = sys.argv[1], sys.argv[2:]
    if what == "greedy":
        out = greedy(int(args[0]), int(args[1]), args[2], float(args[3]))
    elif what == "polite":
        out = polite(int(args[0]), args[1], float(args[2]))
    else:
        raise SystemExit(f"unknown client {what!r}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
