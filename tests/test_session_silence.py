"""A client while its broker is away (spec §5): what it sends into a socket that no broker reads.

ZeroMQ keeps every message a client sends while no broker reads it (the client socket has no send
high-water mark: a pump round never blocks), so a client that said HELLO again every heartbeat
piled up one HELLO, with its whole held list (up to 1.3 MB), per heartbeat of the outage. The
rule: HELLO again only after something came since the last one; meanwhile PING, which a broker
that lost the HELLO answers ``not_registered``, and that answer sends the next HELLO.

A fake broker (tests/fakebroker.py) plays the broker, so the session is in exactly the state each
test names; every wait is for a message, none for time, and with a heartbeat of 20 ms each test
reads its messages within a second."""

from __future__ import annotations

import pytest

from fakebroker import FakeBroker, spin_until
from hurray_ipc.client.session import Session
from hurray_ipc.wire.messages import Error, Shutdown, Welcome

HEARTBEAT_S = 0.02
WELCOME = Welcome(session="ab" * 8, heartbeat_ms=20, timeout_ms=60_000, fence_ms=60_000)


@pytest.fixture
def session(fake: FakeBroker):
    """A consumer session registered with the fake broker (its pump thread running)."""
    s = Session(fake.endpoint, "consumer", "ch", lambda epoch: {"endpoint": {}}, lambda msg: [],
                heartbeat_s=HEARTBEAT_S, timeout_s=60.0)
    assert fake.next_verbs() == ["HELLO"]
    fake.say(WELCOME)
    s.pump(lambda: s.registered, 10, "registering")
    yield s
    s.close()


def _until_verb(fake: FakeBroker, verb: str, within: int) -> int:
    """Read messages until one of ``verb`` came, at most ``within`` of them: how many came before."""
    for n in range(within):
        if verb in fake.next_verbs():
            return n
    raise AssertionError(f"no {verb} among the next {within} messages")


def _shut_down(fake: FakeBroker, s: Session) -> None:
    """The broker says SHUTDOWN; the client's next heartbeat says HELLO again."""
    fake.say(Shutdown())
    _until_verb(fake, "HELLO", 20)  # PINGs sent before it read the SHUTDOWN come first
    assert not s.registered


def test_no_second_hello_while_nothing_answered_the_last(fake: FakeBroker, session: Session) -> None:
    """After SHUTDOWN the client says HELLO once; 10 heartbeats later, with nothing answered, it
    has sent only PINGs since. A client that says HELLO every heartbeat while unregistered fails
    on the first message after the HELLO."""
    _shut_down(fake, session)
    for i in range(10):
        assert fake.next_verbs() == ["PING"], f"message {i + 1} after an unanswered HELLO"


def test_a_ping_answered_not_registered_sends_the_hello_again(fake: FakeBroker, session: Session) -> None:
    """A broker that lost the HELLO (it was in the socket of a broker that died; it was dropped
    unread, spec §6a) answers the next PING ``not_registered``: the client says HELLO again (at
    once, or at its next heartbeat since something came) and registers. A client that says HELLO
    again only when its last one was answered never registers here."""
    _shut_down(fake, session)
    assert fake.next_verbs() == ["PING"]
    fake.say(Error("not_registered", "PING before HELLO (or the broker restarted): send HELLO"))
    _until_verb(fake, "HELLO", 20)
    fake.say(WELCOME)
    # Not session.pump(): it would stop at once, as the broker said SHUTDOWN and no WELCOME came since.
    spin_until(lambda: session.registered, "the pump thread to read the WELCOME")


def test_a_refused_hello_is_sent_again_at_the_next_heartbeat(fake: FakeBroker, session: Session) -> None:
    """A HELLO the broker answered with an ERROR other than ``not_registered`` (a limit, say) was
    read: the client says HELLO again a heartbeat later, not PING forever."""
    _shut_down(fake, session)
    fake.say(Error("limit_exceeded", "too many clients", {"limit": "clients", "value": 16384}))
    # PINGs may leave before the pump thread reads the ERROR (one a heartbeat while it is held
    # up); the HELLO comes after them. A client that only pings fails after 20 of them.
    _until_verb(fake, "HELLO", 20)
