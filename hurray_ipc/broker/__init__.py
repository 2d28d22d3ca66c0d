"""The Hurray broker service (hurray-broker, python -m hurray_ipc.broker)."""

from .server import Broker

__all__ = ["Broker"]
