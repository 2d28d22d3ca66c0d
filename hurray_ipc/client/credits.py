"""Credits asked of the broker and not yet answered (docs/spec/ipc-protocol.md §4).

A consumer asks with REQUEST credits, each answered by one DELIVER; a producer asks with READY
credits, each answered by one GRANT. Either wants ``prefetch`` answers ready ahead of its caller
and asks for what is missing, on a message of its own or carried on another (a RELEASE's
``credits``, a HANDOFF's ``ready``). This is the one place that arithmetic lives, as flow-control
windows do in hyper-h2's ``windows.py``. Not thread-safe: the caller holds its session's lock.
"""

from __future__ import annotations

__all__ = ["Credits"]


class Credits:
    """``asked``: credits sent and not yet answered, as the broker also counts them (spec §4); a
    re-HELLO declares them again."""

    def __init__(self, prefetch: int):
        self.prefetch = prefetch
        self.asked = 0
        self.waiting = False  # a limit refused credits: ask for none until something made room

    def want(self, ready: int, *, at_least: int = 0) -> int:
        """How many more to ask for while ``ready`` answers wait unused: ``prefetch`` (or
        ``at_least``, if more) less those and less what is asked already; never negative, and
        none while :attr:`waiting`."""
        if self.waiting:
            return 0
        return max(0, max(self.prefetch, at_least) - ready - self.asked)

    def ask(self, n: int) -> None:
        """``n`` more were sent."""
        self.asked += n

    def ask_for(self, ready: int) -> int:
        """:meth:`want`, counted as asked at once: the caller sends that many (0: none). It
        carries them on a RELEASE or HANDOFF, which makes room (a delivery or a grant fewer), so
        it asks even while :attr:`waiting`."""
        self.waiting = False
        n = self.want(ready)
        self.asked += n
        return n

    def answered(self, n: int = 1) -> None:
        """``n`` were answered (a GRANT or DELIVER came) or will never be (the message that
        carried them was refused, or never left)."""
        self.asked = max(0, self.asked - n)
        self.waiting = False

    def refused(self, n: int, limit: object) -> None:
        """The broker named ``n`` of them as not applied (spec §2): no longer asked. A limit's
        refusal (``held``, ``queued_credits``) would come back for an ask sent at once, in a loop
        as fast as the round trip (2,788 a second, measured): until something may have made room
        (:meth:`retry`, an answer, or an ask carried on a RELEASE or HANDOFF) :meth:`want` asks
        for none. The message rate's refusal is asked again at once (its allowance refills within
        milliseconds)."""
        self.asked = max(0, self.asked - n)
        if n and limit != "message_rate":
            self.waiting = True

    def retry(self) -> None:
        """Ask again at the next :meth:`want` (the session calls it at each PONG and WELCOME: once
        a heartbeat while nothing else makes room)."""
        self.waiting = False

    def reset(self) -> None:
        """None is asked any more (an ended producer)."""
        self.asked = 0
