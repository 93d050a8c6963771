"""The runtime's lower core: the compute thread, the typed envelopes actors exchange,
the transport protocols and fault plans. ``ppswap.actors`` and ``ppswap.fsdp`` both build
on it; it imports neither (nor any tensor framework).
"""
