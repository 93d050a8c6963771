"""``agree_on_overflow`` across processes: with it every process's GradScaler skips a step
one process overflowed and backs off alike; without it they part ways
(``scripts/overflow.py`` says what each round checks)."""

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
