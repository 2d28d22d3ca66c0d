"""Producer and Consumer: the library's client side of the broker protocol."""

from .consumer import Consumer, ProducerGone, ReceivedBuffer, ReceivedHandoff
from .endpoint import default_endpoint
from .producer import Producer, Ticket
from .session import BrokerUnavailable, RemoteError

__all__ = ["BrokerUnavailable", "Consumer", "Producer", "ProducerGone", "ReceivedBuffer", "ReceivedHandoff",
           "RemoteError", "Ticket", "default_endpoint"]
