"""What travels, as bytes: the IPC protocol's codec (``ipc``: verbs, JSON headers, the binary
batches of the hot verbs, errors) and the one strict validator of received fields (``fields``).
Nothing here knows devices, sockets or state."""
