"""The router's API keys as gpud.core.keys reads them from router.api_keys_file's text: every
field of a key's table, each one's bounds, and the one problem a key is refused with, named."""

from __future__ import annotations

import hashlib

import pytest

from gpud.core.keys import KEY_SHARES, ApiKey, key_digest, key_shares, parse_keys, token_digest

TOKEN = "sk-0123456789abcdef"
OTHER = "sk-fedcba9876543210"
DIGEST = hashlib.sha256(TOKEN.encode()).hexdigest()


def key(name: str = "alice", fields: str = "") -> str:
    return f'[keys.{name}]\ntoken = "{TOKEN}"\nmodels = ["chat"]\n{fields}'


def test_a_key_with_every_field() -> None:
    text = (f'[keys.alice]\ntoken = "{TOKEN}"\nmodels = ["chat", "ocr", "chat"]\n'
            "max_concurrent = 2\nrequests_per_minute = 30\npriority = -3\nweight = 2\n"
            "tokens_per_day = 1000\ntokens_per_month = 20000\npeer = true\n")
    keys, problems = parse_keys(text, ["chat", "ocr"])
    assert problems == []
    assert keys == [ApiKey("alice", DIGEST, ("chat", "ocr"), max_concurrent=2,
                           requests_per_minute=30, priority=-3, weight=2.0, tokens_per_day=1000,
                           tokens_per_month=20000, peer=True)]
    assert type(keys[0].weight) is float


def test_a_key_without_shares_has_the_defaults() -> None:
    keys, problems = parse_keys(key(), ["chat"])
    assert problems == []
    assert keys == [ApiKey("alice", DIGEST, ("chat",))]
    assert (keys[0].max_concurrent, keys[0].requests_per_minute, keys[0].priority,
            keys[0].weight, keys[0].tokens_per_day, keys[0].tokens_per_month, keys[0].peer) == (
        None, None, 0, 1.0, None, None, False)


def test_the_token_is_kept_as_its_sha256_and_a_sha256_as_given_in_lower_case() -> None:
    assert token_digest(TOKEN) == DIGEST
    keys, problems = parse_keys(f'[keys.a]\nsha256 = "{DIGEST.upper()}"\nmodels = ["*"]\n', [])
    assert problems == [] and keys == [ApiKey("a", DIGEST, ("*",))]
    assert key_digest({"token": TOKEN}, "keys.a") == (DIGEST, [])
    assert key_digest({"sha256": DIGEST}, "keys.a") == (DIGEST, [])


@pytest.mark.parametrize(("entry", "problem"), [
    ({"token": TOKEN, "sha256": DIGEST}, "keys.a: token or sha256, not both"),
    ({"sha256": DIGEST[:-1]}, "keys.a.sha256: the token's SHA-256, 64 hex digits"),
    ({"sha256": 5}, "keys.a.sha256: the token's SHA-256, 64 hex digits"),
    ({"token": "x" * 15}, "keys.a.token: at least 16 printable characters, no spaces"),
    ({"token": "sk-0123 456789abcdef"}, "keys.a.token: at least 16 printable characters, "
                                        "no spaces"),
    ({}, "keys.a.token: at least 16 printable characters, no spaces"),
])
def test_a_key_without_one_good_secret_is_named(entry: dict[str, object], problem: str) -> None:
    assert key_digest(entry, "keys.a") == (None, [problem])


def test_a_token_of_16_characters_is_enough() -> None:
    assert key_digest({"token": "x" * 16}, "keys.a") == (token_digest("x" * 16), [])


@pytest.mark.parametrize("field", sorted(KEY_SHARES))
def test_each_share_takes_its_bounds_and_nothing_past_them(field: str) -> None:
    low, high = KEY_SHARES[field]
    whole = field != "weight"
    for value in (low, high):
        got = int(value) if whole else float(value)
        assert key_shares({field: got}, "keys.a") == ({field: got}, [])
        assert type(key_shares({field: got}, "keys.a")[0][field]) is type(got)
    step = 1 if whole else 0.001
    shown = f"{int(low)} to {int(high)}" if whole else f"{low:g} to {high:g}"
    kind = "an integer" if whole else "a number"
    for value in (low - step, high + step):
        got = int(value) if whole else value
        assert key_shares({field: got}, "keys.a") == (
            {}, [f"keys.a.{field}: {kind} from {shown} (got {got!r})"])


def test_a_share_of_the_wrong_type_is_refused() -> None:
    assert key_shares({"max_concurrent": True}, "keys.a")[1] == [
        "keys.a.max_concurrent: an integer from 1 to 65535 (got True)"]
    assert key_shares({"priority": 1.5}, "keys.a")[1] == [
        "keys.a.priority: an integer from -1000 to 1000 (got 1.5)"]
    assert key_shares({"weight": "x"}, "keys.a")[1] == [
        "keys.a.weight: a number from 0.01 to 1000 (got 'x')"]
    # a whole weight is a weight; every problem of the table is named, the good ones kept
    assert key_shares({"weight": 3, "priority": "x", "max_concurrent": 0,
                       "requests_per_minute": 7}, "keys.a") == (
        {"weight": 3.0, "requests_per_minute": 7},
        ["keys.a.max_concurrent: an integer from 1 to 65535 (got 0)",
         "keys.a.priority: an integer from -1000 to 1000 (got 'x')"])


def test_keys_are_in_name_order_and_a_bad_one_leaves_the_others() -> None:
    text = (key("zed") + f'[keys.bob]\ntoken = "{OTHER}"\nmodels = ["*"]\n'
            '[keys."-x"]\ntoken = "sk-xxxxxxxxxxxxxxxxxx"\nmodels = ["*"]\n')
    keys, problems = parse_keys(text, ["chat"])
    assert [k.name for k in keys] == ["bob", "zed"]
    assert problems == ["keys.-x: not a key name (letters, digits, . _ @ -)"]


def test_not_toml_and_a_file_of_other_tables() -> None:
    keys, problems = parse_keys("[keys.a\n", ["chat"])
    assert keys == [] and len(problems) == 1 and problems[0].startswith("not TOML: ")
    keys, problems = parse_keys("other = 1\n" + key(), ["chat"])
    assert [k.name for k in keys] == ["alice"]
    assert problems == ["other: unknown key (only [keys.NAME] tables)"]
    assert parse_keys("keys = 3", []) == ([], ["keys: must be a table of [keys.NAME] tables"])
    assert parse_keys("", []) == ([], [])


ALLOWED = ("token, sha256, models, max_concurrent, requests_per_minute, priority, weight, "
           "tokens_per_day, tokens_per_month, peer")


@pytest.mark.parametrize(("text", "problem"), [
    ("[keys]\nalice = 3\n", "keys.alice: a table of token (or sha256), models, max_concurrent, "
     "requests_per_minute, priority, weight, tokens_per_day, tokens_per_month and peer only"),
    # each key is refused with its first problem alone, in this order: an unknown field, ...
    (key(fields="budget = 5\nweight = 0\n"),
     f"keys.alice.budget: unknown key (a key's table has {ALLOWED})"),
    (key(fields="mx_concurrent = 1\n"), "keys.alice.mx_concurrent: unknown key; did you mean "
     f"'max_concurrent'? (a key's table has {ALLOWED})"),
    # ... a share, ...
    (key(fields='weight = 0\nsha256 = "00"\n'),
     "keys.alice.weight: a number from 0.01 to 1000 (got 0)"),
    # ... the secret, ...
    (key(fields='sha256 = "00"\npeer = 1\n'), "keys.alice: token or sha256, not both"),
    ('[keys.alice]\ntoken = "short"\nmodels = []\n',
     "keys.alice.token: at least 16 printable characters, no spaces"),
    # ... the peer mark, ...
    (f'[keys.alice]\ntoken = "{TOKEN}"\nmodels = []\npeer = 1\n',
     "keys.alice.peer: true or false (got 1): true marks the key another gpud host presents, "
     "whose forwarded requester is taken"),
    # ... the models, ...
    (f'[keys.alice]\ntoken = "{TOKEN}"\nmodels = []\n',
     'keys.alice.models: a list of model names (or ["*"])'),
    (f'[keys.alice]\ntoken = "{TOKEN}"\nmodels = "chat"\n',
     'keys.alice.models: a list of model names (or ["*"])'),
    (f'[keys.alice]\ntoken = "{TOKEN}"\nmodels = ["chat", 3]\n',
     'keys.alice.models: a list of model names (or ["*"])'),
    (f'[keys.alice]\ntoken = "{TOKEN}"\n',
     'keys.alice.models: a list of model names (or ["*"])'),
    (f'[keys.alice]\ntoken = "{TOKEN}"\nmodels = ["chat", "nope", "no2", "*"]\n',
     "keys.alice.models: no serve answers to 'nope', 'no2'"),
])
def test_a_bad_key_is_named_with_its_first_problem(text: str, problem: str) -> None:
    keys, problems = parse_keys(text, ["chat"])
    assert keys == [] and problems == [problem]


def test_one_token_on_two_keys_is_refused_on_the_second() -> None:
    text = key("alice") + key("bob")
    keys, problems = parse_keys(text, ["chat"])
    assert [k.name for k in keys] == ["alice"]
    assert problems == ["keys.bob.token: the same token as keys.alice"]
    keys, problems = parse_keys(key("alice") + f'[keys.bob]\nsha256 = "{DIGEST}"\n'
                                'models = ["*"]\n', ["chat"])
    assert [k.name for k in keys] == ["alice"]
    assert problems == ["keys.bob.sha256: the same token as keys.alice"]
    # a refused key's token is not taken: the next key with it is the first
    keys, problems = parse_keys(
        f'[keys.a]\ntoken = "{TOKEN}"\nmodels = ["nope"]\n' + key("b"), ["chat"])
    assert [k.name for k in keys] == ["b"]


def test_a_peer_key_is_marked() -> None:
    keys, problems = parse_keys(key(fields="peer = false\n") + f'[keys.p]\ntoken = "{OTHER}"\n'
                                'models = ["*"]\npeer = true\n', ["chat"])
    assert problems == [] and [(k.name, k.peer) for k in keys] == [("alice", False), ("p", True)]


@pytest.mark.parametrize(("field", "low", "high", "shown"), [
    # nginx's limit_conn takes less than 65536 (ngx_http_limit_conn_module.c)
    ("max_concurrent", 1, 65_535, "1 to 65535"),
    ("requests_per_minute", 1, 1_000_000, "1 to 1000000"),
    ("priority", -1000, 1000, "-1000 to 1000"),
    # docs/router.md, "Budgets": a whole number of tokens from 0 (nothing let in) to 10^15
    ("tokens_per_day", 0, 10**15, "0 to 1000000000000000"),
    ("tokens_per_month", 0, 10**15, "0 to 1000000000000000"),
])
def test_a_keys_whole_shares_and_their_bounds(field: str, low: int, high: int,
                                              shown: str) -> None:
    for value in (low, high):
        keys, problems = parse_keys(key(fields=f"{field} = {value}\n"), ["chat"])
        assert problems == [] and getattr(keys[0], field) == value
    for value in (low - 1, high + 1):
        keys, problems = parse_keys(key(fields=f"{field} = {value}\n"), ["chat"])
        assert keys == [] and problems == [
            f"keys.alice.{field}: an integer from {shown} (got {value})"]
