"""The Hurray broker service (hurray-broker, python -m broker)."""

from .server import Broker

__all__ = ["Broker"]
