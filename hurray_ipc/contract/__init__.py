"""The synchronisation contract (docs/spec/sync-contract.md): valid modes per transport, and the handoff object."""

from .handoff import AlreadyReleasedError, Handoff, HandoffError
from .sync import (
    EndpointCapabilities,
    Transport,
    check_network_handle,
    choose_sync_mode,
    consumer_obligation,
    explain_sync_modes,
    valid_sync_modes,
)

__all__ = [
    "AlreadyReleasedError",
    "EndpointCapabilities",
    "Handoff",
    "HandoffError",
    "Transport",
    "check_network_handle",
    "choose_sync_mode",
    "consumer_obligation",
    "explain_sync_modes",
    "valid_sync_modes",
]
