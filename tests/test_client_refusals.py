"""What a client does with credits the broker refused (a REQUEST or READY past its message rate,
or credits a RELEASE or HANDOFF carried past a limit, spec §2, §6a): the refusal names them, as
never applied, and the client asks for them again. A client that kept counting them as asked
asked for nothing more and waited for a delivery (or a grant) that could not come, until its
timeout.

A fake broker (tests/fakebroker.py) refuses the first ask and nothing else; with a heartbeat of a
minute no PING arrives, so the next message the fake reads is the second ask, or nothing within
10 s."""

from __future__ import annotations

import contextlib
import threading

import pytest

from fakebroker import FakeBroker
from hurray_ipc.client import Consumer, Producer
from hurray_ipc.errors import ClosedError, HurrayTimeout
from hurray_ipc.wire.ipc import decode_all
from hurray_ipc.wire.messages import Error, Pong, Welcome

WELCOME = Welcome(session="ab" * 8, heartbeat_ms=60_000, timeout_ms=120_000, fence_ms=120_000)


def _rate_refusal(verb: str, credits: int) -> Error:
    """The broker's refusal of a message past the rate, as core._rate_refusal words it."""
    return Error("limit_exceeded", "a client may send at most 50000 messages per second; this one was dropped",
                 {"ref": verb, "limit": "message_rate", "value": 50000, "credits": credits})


def _carried_refusal(verb: str, credits: int) -> Error:
    """The broker's refusal of credits a RELEASE or HANDOFF carried past a limit (spec §6a)."""
    ref, field = ("RELEASE", "credits") if verb == "REQUEST" else ("HANDOFF", "ready")
    return Error("limit_exceeded", "a consumer may hold at most 8192 deliveries and credits not yet delivered",
                 {"ref": ref, "field": field, "limit": "held", "value": 8200, "credits": credits})


def _ask(fake: FakeBroker) -> tuple[str, int]:
    """The next message, which must be a lone REQUEST or READY: its verb and credits."""
    (msg,) = decode_all(fake.next())
    assert msg.verb in ("REQUEST", "READY"), msg.verb
    return msg.verb, msg.header["credits"]


@pytest.mark.parametrize("refusal", [_rate_refusal, _carried_refusal])
@pytest.mark.parametrize("role", ["consumer", "producer"])
def test_credits_a_refusal_names_are_asked_again(fake: FakeBroker, role: str, refusal) -> None:
    """Whatever the refused message: before, only a REQUEST's or READY's refusal counted (spec §2)."""
    kw = {"prefetch": 3, "heartbeat_s": 60.0, "timeout_s": 120.0}
    client = Consumer(fake.endpoint, "ch", **kw) if role == "consumer" else Producer(fake.endpoint, "ch", **kw)
    waiting = threading.Thread(target=lambda: None)
    try:
        assert decode_all(fake.next())[0].verb == "HELLO"
        fake.say(WELCOME)
        # The consumer asks when receive() waits, the producer when send() waits for a grant.
        call = (lambda: client.receive(timeout=20)) if role == "consumer" else \
            (lambda: client.send(b"x" * 16, timeout=20))
        waiting = threading.Thread(target=_swallow, args=(call,), daemon=True)
        waiting.start()
        verb, n = _ask(fake)
        assert (verb, n) == (("REQUEST" if role == "consumer" else "READY"), 3)
        fake.say(refusal(verb, n))
        if refusal is _carried_refusal:
            # A limit would refuse an ask sent at once again, in a loop as fast as the round trip:
            # the client asks again once something may have made room, here the next PONG.
            assert not fake.router.poll(500), "asked again at once: a busy loop while the limit holds"
            fake.say(Pong())
        assert _ask(fake) == (verb, 3), "the refused credits were asked again"
    finally:
        client.session.close()  # not client.close(): the fake answers no BYE or END
        if waiting.ident is not None:
            waiting.join(30)


def _swallow(call) -> None:
    """Run ``call``; the session closing under it ends it with an error the test expects."""
    with contextlib.suppress(ClosedError, HurrayTimeout):
        call()
