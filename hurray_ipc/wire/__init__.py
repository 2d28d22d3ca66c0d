"""What travels, as bytes, and its typed form: the IPC protocol's codec (``ipc``: verbs, JSON
headers, the binary batches of the hot verbs, errors), the interchange link's messages (``link``:
one frozen dataclass per verb, decoded and validated once) and the one strict validator of received
fields (``fields``). Nothing here knows devices, sockets or state."""
