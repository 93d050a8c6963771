"""Tied parameters under torchrun (``scripts/tied.py``): a GPT-2 style model whose head
and embedding are declared copies on the first and the last rank equals the unsplit model
in loss and every gradient, the two holders' tied gradients are the same bits (the same
digest), swap on as off, with the dx/dw split and with overlap_b_f, and the same bits as
the same stages run in one process; with three ranks the middle one, which holds no
copy, still takes part in the exchange of declarations."""

from __future__ import annotations

import importlib.util
import re
import sys
from types import ModuleType

import anyio
import pytest
from launch import SCRIPTS, launch

from ppswap import PipelineStage, run_schedule

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.slow


def tied_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tied_script", SCRIPTS / "tied.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def digests(output: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for case, digest in re.findall(r"rank \d+ (\S+) tied ([0-9a-f]+)", output):
        found.setdefault(case.rsplit("-swap-", 1)[0], set()).add(digest)
    return found


async def in_one_process(script: ModuleType, name: str, ranks: int) -> str:
    """The digest of the tied gradient when every stage of the case runs in this
    process (the in-process transport: the framework adds the shares)."""
    schedule, vpp, options = script.CASES[name]
    stage_num = ranks * vpp
    modules = script.tied_modules(stage_num, shared=False)
    tied = {0: script.TIED[0], stage_num - 1: script.TIED[-1]}
    stages = [PipelineStage(m, s, stage_num, tied=tied.get(s)) for s, m in enumerate(modules)]
    x, y = script.tokens(batch=4 * ranks)
    await run_schedule(
        stages,
        schedule,
        pp=ranks,
        micro_batch_num=ranks,
        inputs=x,
        targets=y,
        loss_fn=script.lm_loss,
        step_timeout=60.0,
        **options,
    )
    digest: str = script.tied_digest(stages[0])
    assert digest == script.tied_digest(stages[-1])
    return digest


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 3])
def test_tied_copies_sum_across_processes(ranks: int) -> None:
    result = launch(ranks, "tied.py", "torch", timeout_s=240)
    assert result.returncode == 0, result.output
    for rank in range(ranks):
        assert f"rank {rank} OK" in result.output, result.output
    script = tied_script()
    found = digests(result.output)
    assert set(found) == set(script.CASES), result.output
    assert all(len(one) == 1 for one in found.values()), result.output
    # 1F1B and Interleaved swap off and on, split_dw and overlap swap on: 2 holders each
    assert len(re.findall(r"rank \d+ \S+ tied", result.output)) == 12, result.output
    for name, (digest,) in found.items():
        assert anyio.run(in_one_process, script, name, ranks) == digest, name
