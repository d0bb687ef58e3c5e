"""The shared body and query readers alone, no server: typed fields, metadata, list limits and
file expiry, each accepted and refused input with the field the 400 names."""

from __future__ import annotations

import pytest

from server.api.batch.files import expires_after
from server.api.errors import APIError
from server.api.fields import INT64, Fields, parse_metadata
from server.api.pagination import int_param, page


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_typed_reads_and_their_defaults():
    f = Fields({"s": "x", "b": True, "i": 3.0, "x": 0.25})
    assert (f.str("s"), f.bool("b"), f.int("i"), f.float("x", 1.0)) == ("x", True, 3, 0.25)
    assert (f.str("none", "d"), f.bool("none"), f.int("none", 5), f.float("none", 1.5)) == (
        "d", False, 5, 1.5)
    f.check_unknown()  # every key was read


@pytest.mark.parametrize(("body", "read"), [
    ({"a": 1}, lambda f: f.str("a")),
    ({}, lambda f: f.str("a", required=True)),
    ({"a": "yes"}, lambda f: f.bool("a")),
    ({"a": 1.5}, lambda f: f.int("a")),
    ({"a": True}, lambda f: f.int("a")),  # a bool is not an integer here
    ({"a": INT64[1] + 1}, lambda f: f.int("a")),
    ({"a": 0}, lambda f: f.int("a", lo=1)),
    ({"a": float("nan")}, lambda f: f.float("a", 1.0)),
    ({"a": 0.0}, lambda f: f.float("a", 1.0, 0.0, 1.0, lo_open=True)),
    ({"a": 3}, lambda f: f.float("a", 1.0, 0.0, 2.0)),
    ({"a": "x"}, lambda f: f.refuse("a")),
    ({"a": 1}, lambda f: f.check_unknown()),
])
def test_refused_fields_are_named(body, read):
    assert refused(read, Fields(body)).param == "a"


def test_refuse_lets_values_that_change_nothing_pass():
    f = Fields({"a": None, "b": [], "c": "auto"})
    f.refuse("a"), f.refuse("b"), f.refuse("c", (None, "auto"))
    f.check_unknown()


def test_metadata():
    assert parse_metadata(None) is None
    assert parse_metadata({"k": "v"}) == {"k": "v"}
    for bad in ("x", {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": 1},
                {"k": "v" * 513}):
        assert refused(parse_metadata, bad).param == "metadata"


def test_list_limits_and_pages():
    assert int_param(None, "limit", 20, 1, 100) == 20
    assert int_param("7", "limit", 20, 1, 100) == 7
    assert refused(int_param, "x", "limit", 20, 1, 100).param == "limit"
    assert refused(int_param, "101", "limit", 20, 1, 100).param == "limit"
    assert page([{"id": "a"}, {"id": "b"}], has_more=True) == {
        "object": "list", "data": [{"id": "a"}, {"id": "b"}], "first_id": "a", "last_id": "b",
        "has_more": True}
    assert page([], has_more=False)["first_id"] is None


def test_file_expiry():
    assert expires_after(None, "expires_after") is None
    assert expires_after({"anchor": "created_at", "seconds": 3600}, "expires_after") == 3600
    assert expires_after({"anchor": "created_at", "seconds": "7200"}, "e") == 7200  # a form
    for bad, param in ((5, "e"), ({"anchor": "created_at", "seconds": 60}, "e.seconds"),
                       ({"anchor": "last_active_at", "seconds": 3600}, "e.anchor"),
                       ({"anchor": "created_at", "seconds": 3600, "x": 1}, "e.x")):
        assert refused(expires_after, bad, "e").param == param
