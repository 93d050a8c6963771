"""The batch both the MPI ranks and the in-process reference train on (no MPI import)."""

from __future__ import annotations

import numpy as np

DIM, BATCH = 8, 8


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return (
        rng.standard_normal((BATCH, DIM)).astype(np.float32),
        rng.standard_normal((BATCH, DIM)).astype(np.float32),
    )
