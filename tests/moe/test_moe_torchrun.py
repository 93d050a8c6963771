"""Expert parallelism across processes over TorchDistTransport (gloo): ``torchrun
--nproc_per_node 4``, pp2 x dp2 x ep2, torch MoE stages, 1F1B with overlap_b_f. Each
rank's loss and local gradients equal the unsplit model's (rtol 1e-5), swap on equals
swap off bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch.distributed")

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from moe_run import MESH, MICRO, TOP_K  # noqa: E402
from moe_support import check_process_run  # noqa: E402
from process_group import run_group  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "moe_run.py"


def test_pp2_ep2_under_torchrun_equals_the_unsplit_model(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(MESH.world_size),
        str(SCRIPT),
        str(tmp_path),
        "torch",
    ]
    result = run_group(
        command, env={"OMP_NUM_THREADS": "1"}, timeout_s=300, what="torchrun moe_run.py"
    )
    assert result.returncode == 0, result.output
    check_process_run(tmp_path, MESH, MICRO, TOP_K, stage_num=MESH.pp)
