"""torch pipelines over TorchDistTransport, one process per rank (``torchrun``, gloo).

``scripts/pipeline.py`` runs each case swap off and on and checks, per rank: swap on is
bit-identical to swap off; losses and gradients equal one unsplit torch model (rtol 1e-5);
bytes moved exactly where the plan swaps; and (rank 0) every rank's gradients are
bit-identical to the same run in one process. It prints one OK line per case and rank.

At 2 processes every case: GPipe, 1F1B and Interleaved (vpp 2) in every P2P mode, each
with ``split_dw``, and 1F1B and Interleaved with ``overlap_b_f`` with and without
``split_dw``. At 4 processes every family in every P2P mode, and each variant of each
family once (the P2P mode rotating). Both also run three cases with activations above the
16 KiB inline limit the script gives its transport (one per P2P mode), three cases in
bfloat16, three with dropout after every stage, three passing a tuple of tensors between
stages (one per family and per P2P mode each) and two under the caller's ``torch.autocast``.
A last launch
perturbs two cases' results on purpose and must fail, naming them, so the checks cannot
pass vacuously. ``scripts/inference.py`` checks forward-only runs without ``loss_fn``: the
last stage's outputs in its process, none elsewhere.
"""

from __future__ import annotations

import re

import pytest
from launch import Launch, launch

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.slow

P2P_MODES = ("plain", "batch", "boundary")
VARIANTS = {
    "gpipe": ("", "-dw"),  # GPipe has no steady state to overlap (overlap_b_f is refused)
    "1f1b": ("", "-dw", "-overlap", "-dw-overlap"),
    "interleaved": ("", "-dw", "-overlap", "-dw-overlap"),
}
EVERY_CASE = [
    f"{f}-{p2p}{v}" for f, variants in VARIANTS.items() for p2p in P2P_MODES for v in variants
]
FOUR_RANK_CASES = [f"{f}-{p2p}" for f in VARIANTS for p2p in P2P_MODES] + [
    f"{f}-{P2P_MODES[i % len(P2P_MODES)]}{v}"
    for f, variants in VARIANTS.items()
    for i, v in enumerate(variants[1:])
]
# Micro-batches of 160 samples: activations and gradients of 20 KiB, sent as a header and
# a body (above the script's 16 KiB inline limit), in each P2P mode.
BIG_CASES = ["gpipe-boundary-big", "1f1b-plain-overlap-big", "interleaved-batch-dw-overlap-big"]
# A bfloat16 model and batch: every family, every P2P mode once.
BF16_CASES = ["gpipe-plain-bf16", "1f1b-boundary-dw-bf16", "interleaved-batch-dw-overlap-bf16"]
# Dropout after every stage: the masks must not depend on the process layout.
DROPOUT_CASES = [
    "gpipe-plain-dropout",
    "1f1b-boundary-dw-overlap-dropout",
    "interleaved-batch-dropout",
]
# (hidden, mask, scale) between stages, packed between processes: inline and as a body.
TUPLE_CASES = ["gpipe-plain-tuple", "1f1b-boundary-dw-big-tuple", "interleaved-batch-overlap-tuple"]
# Every run under the caller's torch.autocast to bfloat16: each process's compute thread
# takes its own process's.
AUTOCAST_CASES = ["1f1b-batch-dw-autocast", "interleaved-boundary-overlap-autocast"]
SPECIAL_CASES = BIG_CASES + BF16_CASES + DROPOUT_CASES + TUPLE_CASES + AUTOCAST_CASES
CASES_BY_RANKS = {2: EVERY_CASE + SPECIAL_CASES, 4: FOUR_RANK_CASES + SPECIAL_CASES}


def ok_lines(result: Launch, rank: int) -> dict[str, str]:
    """The cases ``rank`` reported OK, each with the rest of its line."""
    pattern = rf"^rank {rank} case (\S+) OK (.*)$"
    return {m[1]: m[2] for m in re.finditer(pattern, result.output, flags=re.MULTILINE)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 4])
def test_pipeline_cases_match_swap_off_unsplit_and_in_process(ranks: int) -> None:
    cases = CASES_BY_RANKS[ranks]
    assert len(set(cases)) == len(cases)
    result = launch(ranks, "pipeline.py", *cases, timeout_s=240)
    assert result.returncode == 0, result.output
    assert "MISMATCH" not in result.output, result.output
    swapped = set()
    for rank in range(ranks):
        reported = ok_lines(result, rank)
        assert sorted(reported) == sorted(cases), result.output
        swapped |= {case for case, rest in reported.items() if "offloaded=0 " not in rest}
    assert swapped == set(cases)  # every case moved activations on some rank


@pytest.mark.timeout(150)
def test_a_perturbed_result_fails_the_run_naming_the_case() -> None:
    """One ulp on a swap-on gradient breaks bit-identity (swap off and in-process); a
    gradient scaled by 1 + 1e-3 in both runs breaks the unsplit and in-process checks
    only. The unperturbed case still passes; every rank exits non-zero."""
    ulp, scaled, clean = "gpipe-plain", "interleaved-batch-dw-overlap", "1f1b-boundary"
    result = launch(
        2,
        "pipeline.py",
        ulp,
        scaled,
        clean,
        "--perturb",
        f"{ulp}=swap",
        "--perturb",
        f"{scaled}=unsplit",
        timeout_s=120,
    )
    out = result.output
    assert result.returncode != 0, out
    mismatches = set(re.findall(r"^(rank \d case \S+ MISMATCH: .*?)(?: \(max.*)?$", out, re.M))
    assert mismatches == {
        f"rank 1 case {ulp} MISMATCH: swap on != swap off: stage 1 grad 0 not bit-identical",
        f"rank 0 case {ulp} MISMATCH: distributed != in-process: "
        "rank 1's gradients are not bit-identical to the in-process run",
        f"rank 1 case {scaled} MISMATCH: swap off: stage 1 grad 0 differs from the unsplit model",
        f"rank 1 case {scaled} MISMATCH: swap on: stage 1 grad 0 differs from the unsplit model",
        f"rank 0 case {scaled} MISMATCH: distributed != in-process: "
        "rank 1's gradients are not bit-identical to the in-process run",
    }, out
    for rank in range(2):
        assert sorted(ok_lines(result, rank)) == [clean], out
    # (the first rank to exit makes torchrun end the other, which may not get to print it)
    assert re.search(r"^rank \d: 2 of 3 cases failed$", out, re.M), out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks", [2, 4])
def test_inference_outputs_stay_with_the_last_stage(ranks: int) -> None:
    """Forward-only runs without loss_fn (``scripts/inference.py``): the last stage's
    process gets one output per micro-batch, equal to the unsplit model's; the others
    get none."""
    result = launch(ranks, "inference.py", timeout_s=120)
    assert result.returncode == 0, result.output
    assert "MISMATCH" not in result.output, result.output
    last = ranks - 1  # the last stage of GPipe and of Interleaved (vpp 2) both run there
    for rank in range(ranks):
        for schedule in ("gpipe", "interleaved_1f1b"):
            outputs = 2 * ranks if rank == last else 0
            assert f"rank {rank} {schedule} OK outputs={outputs}" in result.output, result.output
