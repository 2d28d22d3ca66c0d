"""Producer and Consumer: the library's client side of the broker protocol."""

from ..errors import BrokerUnavailable, ProducerGone, RemoteError
from .consumer import Consumer, ReceivedBuffer, ReceivedHandoff
from .endpoint import default_endpoint
from .producer import Producer, Ticket

__all__ = ["BrokerUnavailable", "Consumer", "Producer", "ProducerGone", "ReceivedBuffer", "ReceivedHandoff",
           "RemoteError", "Ticket", "default_endpoint"]
