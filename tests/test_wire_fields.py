"""hurray_ipc/wire/fields.py: the one strict field validator every protocol's decoder uses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hurray_ipc.transport.pairing import Endpoint
from hurray_ipc.transport.route import Route
from hurray_ipc.wire.fields import ABSENT, FieldError, check, obj, one_of, shown, take
from hurray_ipc.wire.ipc import Message, ProtocolError
from hurray_ipc.wire.messages import Request
from test_protocol_raw import endpoint_dict

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=80),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)


def test_a_boolean_is_no_integer_and_nothing_is_coerced():
    with pytest.raises(FieldError) as e:
        check(True, "a.b", int)
    assert (e.value.path, e.value.value) == ("a.b", True) and "must be int" in str(e.value)
    with pytest.raises(FieldError):
        check("3", "a", int)
    assert check(True, "a", bool) is True and check(None, "a", (int, type(None))) is None


def test_bounds_name_the_field_and_the_value():
    with pytest.raises(FieldError, match=r"^n must be in 1\.\.4, got 5$"):
        check(5, "n", int, lo=1, hi=4)
    with pytest.raises(FieldError, match="at most 3 characters, got 4"):
        check("abcd", "s", str, max_len=3)
    with pytest.raises(FieldError, match="1-3 items, got 0"):
        check([], "l", list, min_len=1, max_len=3)


def test_take_absent_default_and_present_null():
    assert take({}, "x.y", int, 7) == 7
    with pytest.raises(FieldError, match=r"^x\.y is missing$") as e:
        take({}, "x.y", int)
    assert e.value.value is ABSENT
    with pytest.raises(FieldError):  # a present null is a value: refused unless null is allowed
        take({"y": None}, "x.y", int, 7)


def test_one_of_is_typed_and_obj_wants_an_object():
    assert one_of("zmq", "p", ("nixl", "zmq")) == "zmq" and one_of(None, "g", (None, "device")) is None
    with pytest.raises(FieldError):
        one_of(True, "p", (1, 2))  # JSON true is not 1
    with pytest.raises(FieldError, match="must be an object, got list"):
        obj([], "endpoint")


@given(JSON)
def test_shown_is_small_and_never_raises(v):
    s = shown({"f": v}, "f")
    assert s is None or isinstance(s, int | float) or (isinstance(s, str) and len(s) <= 64)
    assert shown({"f": v}, "f.g.h") == (shown(v, "g.h") if isinstance(v, dict) else None)


@given(JSON)
def test_every_consumer_of_the_validator_refuses_with_its_own_error_never_another(v):
    """A field of any JSON shape: HELLO's endpoint refuses with ValueError, a header field with
    ProtocolError, a ROUTE with ProtocolError bad_header naming a route field: nothing else escapes."""
    try:
        Endpoint.from_dict(v)
    except ValueError:
        pass
    try:
        Request.parse(Message("REQUEST", {"credits": v}))
    except ProtocolError as e:
        assert e.code == "bad_header" and e.extra["field"] == "credits"
    try:
        Route.parse(v, "consumer")
    except ProtocolError as e:
        assert e.code == "bad_header" and str(e.extra["field"]).startswith("route")


def _paths(d: object, prefix: str = "") -> list[str]:
    """Every dotted path into ``d`` (objects and arrays), leaves and inner nodes."""
    out = []
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        path = f"{prefix}.{k}" if prefix else str(k)
        out += [path, *_paths(v, path)]
    return out


def _replaced(d: object, path: str, value: object) -> object:
    if not path:
        return value
    head, _, rest = path.partition(".")
    if isinstance(d, dict):
        return {**d, head: _replaced(d[head], rest, value)}
    return [(_replaced(x, rest, value) if i == int(head) else x) for i, x in enumerate(d)]  # type: ignore[arg-type]


VALID_ENDPOINT = endpoint_dict(4242, ipc_events=True, uuid="GPU-0")
VALID_ROUTE = {"direction": "export", "links": [{"peer": "tcp://h:1", "data_plane": "zmq", "gpu": None,
                                                 "window": 2}]}


@given(st.sampled_from(_paths(VALID_ENDPOINT)), JSON)
def test_one_field_of_a_valid_endpoint_replaced_is_accepted_or_refused_naming_a_field(path, v):
    """Nested fields are reached (not stopped at the top-level object check): a replaced field is
    either valid or refused with a message naming an endpoint path; nothing else escapes."""
    Endpoint.from_dict(VALID_ENDPOINT)
    try:
        Endpoint.from_dict(_replaced(VALID_ENDPOINT, path, v))
    except FieldError as e:
        assert e.path.startswith("endpoint"), e.path
    except ValueError as e:
        assert str(e).startswith("endpoint"), e


@given(st.sampled_from(_paths(VALID_ROUTE)), JSON)
def test_one_field_of_a_valid_route_replaced_is_accepted_or_refused_naming_it(path, v):
    Route.parse(VALID_ROUTE, "consumer")
    try:
        Route.parse(_replaced(VALID_ROUTE, path, v), "consumer")
    except ProtocolError as e:
        assert e.code == "bad_header" and str(e.extra["field"]).startswith("route"), e.extra


def test_a_nested_fault_names_its_full_path():
    with pytest.raises(FieldError) as e:
        Endpoint.from_dict(_replaced(VALID_ENDPOINT, "caps.ipc_events", "false"))
    assert e.value.path == "endpoint.caps.ipc_events" and e.value.value == "false"
    with pytest.raises(ProtocolError) as r:
        Route.parse(_replaced(VALID_ROUTE, "links.0.window", True), "consumer")
    assert r.value.extra["field"] == "route.links.0.window"
