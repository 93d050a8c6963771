"""The optimizer-step helpers across processes (``ppswap/backends/torch/optim.py``):
``agree_on_overflow`` makes every process's GradScaler skip a step one process overflowed
and back off alike, where without it they part ways (``scripts/overflow.py``);
``clip_grad_norm_`` clips by the norm of every process's gradients together, as torch's
clipping of the unsplit model does (``scripts/clip.py``)."""

from __future__ import annotations

import pytest
from launch import launch

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_scaler_skips_when_one_process_overflowed(ranks: int) -> None:
    result = launch(ranks, "overflow.py", timeout_s=120)
    assert result.returncode == 0, result.output
    for rank in range(ranks):
        for name in ("alone", "agreed", "finite", ""):
            line = f"rank {rank} {name} OK" if name else f"rank {rank} OK"
            assert line in result.output, result.output


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks", [2, 3])
def test_clipping_uses_the_norm_of_every_process_gradients(ranks: int) -> None:
    result = launch(ranks, "clip.py", timeout_s=120)
    assert result.returncode == 0, result.output
    for rank in range(ranks):
        for norm in ("2.0", "inf"):
            for max_norm in ("0.5", "1000000.0"):
                assert f"rank {rank} norm={norm} max_norm={max_norm} OK" in result.output
        assert f"rank {rank} OK" in result.output, result.output
