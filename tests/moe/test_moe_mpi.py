"""Expert parallelism across processes over MPITransport: ``mpiexec -n 4``, pp2 x dp2 x
ep2, torch MoE stages, 1F1B with overlap_b_f. Each rank's loss and local gradients
(dense shards, its own experts) equal the unsplit model's (rtol 1e-5), swap on equals
swap off bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from moe_run import MESH, MICRO, TOP_K  # noqa: E402
from moe_support import check_process_run  # noqa: E402
from test_mpi_transport import launch, needs_mpiexec  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "moe_run.py"


@needs_mpiexec
def test_pp2_ep2_over_mpi_equals_the_unsplit_model(tmp_path: Path) -> None:
    result = launch(MESH.world_size, str(SCRIPT), str(tmp_path), "mpi", timeout_s=300)
    assert result.returncode == 0, result.output
    check_process_run(tmp_path, MESH, MICRO, TOP_K, stage_num=MESH.pp)
