"""Transport: socket calls, pairing rules (which sync modes a pair of endpoints allows), liveness
leases, bridge routes, the in-process registry. The codec of the messages is ``hurray_ipc.wire``."""
