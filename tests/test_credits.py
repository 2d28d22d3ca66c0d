"""The client's credit arithmetic (hurray_ipc/client/credits.py), without a broker."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from hurray_ipc.client.credits import Credits


def test_asks_for_what_is_missing_of_prefetch_and_no_more():
    c = Credits(4)
    assert c.want(0) == 4 and c.ask_for(0) == 4 and c.asked == 4
    assert c.want(0) == 0, "what was asked is not asked again"
    c.answered()  # a DELIVER came: one ready now, three still asked
    assert c.want(1) == 0 and c.asked == 3
    assert c.want(0) == 1  # the caller took it: one is missing
    assert Credits(0).want(0) == 0 and Credits(0).want(0, at_least=1) == 1  # a waiting receive() asks one


def test_a_refused_message_gives_back_what_it_asked():
    c = Credits(2)
    n = c.ask_for(0)
    c.answered(n)  # the message carrying them never left
    assert c.asked == 0 and c.want(0) == 2


@settings(derandomize=True)
@given(st.integers(0, 64), st.lists(st.tuples(st.sampled_from(["ask_for", "answered", "ask", "reset"]),
                                              st.integers(0, 70)), max_size=50))
def test_never_negative_and_never_short_after_asking(prefetch, steps):
    c = Credits(prefetch)
    for op, x in steps:
        if op == "ask_for":
            c.ask_for(x)
            assert x + c.asked >= prefetch, "after asking, ready + asked covers prefetch"
        elif op == "answered":
            c.answered(x)
        elif op == "ask":
            c.ask(x)
        else:
            c.reset()
        assert c.asked >= 0 and c.want(x) >= 0
