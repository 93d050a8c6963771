"""Transports: how payloads travel between ranks (in-process, MPI), and what a run does
across processes. torch.distributed's transport is in ``ppswap.backends.torch``."""
