"""The interchange link's protocol logic without I/O (sans-I/O, as h11 and hyper-h2 are;
docs/spec/interchange.md): :class:`~hurray_ipc.interchange.receiver.ReceiverCore` decides what a
receiving bridge does, ``hurray_ipc/broker/bridge.py`` does it (sockets, buffers, NIXL, broker)."""
