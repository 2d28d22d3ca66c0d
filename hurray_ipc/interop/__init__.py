"""Adapters between user objects and the device layer: what ``send`` accepts (CUDA Array Interface,
DLPack, the buffer protocol), the DLPack capsules a received buffer exports, and the staging pool
of host slots for the host-staged fallback. The wire is in ``transport/``; this is the array side."""
