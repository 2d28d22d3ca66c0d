"""Transport: the broker wire protocol, pairing rules, object export, staging, in-process registry."""
