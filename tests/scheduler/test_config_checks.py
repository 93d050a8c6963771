"""One checker per option: ``ScheduleConfig`` and ``RunOptions`` refuse a bad value of a
field they share with the same error, and a run's ``ScheduleConfig`` is derived from its
``RunOptions`` (``RunOptions.schedule_config``)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ppswap.options import RunOptions
from ppswap.scheduler.config import ScheduleConfig

V, T = ValueError, TypeError
# (id, the fields given to both, error type, the message)
SHARED: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("unknown schedule", {"schedule": "pipedream"}, V, "schedule must be one of gpipe, 1f1b,"),
    ("schedule not a string", {"schedule": 3}, T, "schedule must be one of gpipe, 1f1b,"),
    ("split_dw not a bool", {"split_dw": 1}, T, "split_dw must be a bool (True or False), got 1"),
    ("overlap_b_f not a bool", {"overlap_b_f": "no"}, T, "overlap_b_f must be a bool"),
    ("swap not a bool", {"swap": None}, T, "swap must be a bool (True or False), got None"),
    ("forward_only not a bool", {"forward_only": 0}, T, "forward_only must be a bool"),
    ("unknown p2p", {"p2p": "udp"}, V, "p2p must be one of plain, batch, boundary, got 'udp'"),
    ("min_swap_gap 1", {"min_swap_gap": 1}, V, "min_swap_gap must be an int >= 2, got 1"),
    ("min_swap_gap a float", {"min_swap_gap": 4.0}, T, "min_swap_gap must be an int >= 2"),
    ("gpipe with overlap", {"schedule": "gpipe", "overlap_b_f": True}, V, "'gpipe' has none"),
    ("forward-only with swap", {"forward_only": True, "swap": True}, V,
     "swap must be False for a forward-only run, got swap=True"),
    ("forward-only with split_dw", {"schedule": "1f1b", "forward_only": True, "split_dw": True},
     V, "split_dw and overlap_b_f need a backward"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "error", "message"), [case[1:] for case in SHARED], ids=[c[0] for c in SHARED]
)
def test_a_shared_field_is_refused_alike(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as by_config:
        ScheduleConfig(**fields)
    with pytest.raises(error) as by_options:
        RunOptions(micro_batch_num=4, **fields)
    assert message in str(by_config.value)
    assert str(by_options.value) == str(by_config.value)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"pp": 0}, ValueError, "pp must be an int >= 1, got 0"),
        ({"vpp": True}, TypeError, "vpp must be an int >= 1, got True"),
        ({"micro": "4"}, TypeError, "micro must be an int >= 1, got '4'"),
        ({"fsdp": 1}, TypeError, "fsdp must be a bool (True or False), got 1"),
        ({"schedule": "1f1b", "vpp": 2}, ValueError, "vpp must be 1 for schedule '1f1b'"),
    ],
)
def test_the_sizes_are_checked_by_schedule_config(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        ScheduleConfig(**fields)


def test_the_run_config_is_derived_from_the_options() -> None:
    options = RunOptions(
        micro_batch_num=6,
        schedule="1f1b",
        split_dw=True,
        overlap_b_f=True,
        p2p="batch",
        swap=True,
        min_swap_gap=3,
    )
    config = options.schedule_config(pp=3, vpp=1, fsdp=True)
    assert config == ScheduleConfig(
        schedule="1f1b",
        pp=3,
        vpp=1,
        micro=6,
        split_dw=True,
        overlap_b_f=True,
        p2p="batch",
        fsdp=True,
        swap=True,
        min_swap_gap=3,
    )
    assert (
        RunOptions(micro_batch_num=2, forward_only=True)
        .schedule_config(pp=1, vpp=1, fsdp=False)
        .forward_only
    )


def test_what_depends_on_the_sizes_is_refused_when_the_config_is_derived() -> None:
    options = RunOptions(micro_batch_num=3, schedule="interleaved_1f1b", pp=2)
    with pytest.raises(ValueError, match="micro must be a multiple of pp=2"):
        options.schedule_config(pp=2, vpp=2, fsdp=False)


def test_options_outside_the_schedule_keep_their_own_checks() -> None:
    with pytest.raises(ValueError, match="step_timeout must be a number of seconds > 0"):
        RunOptions(micro_batch_num=1, step_timeout=math.nan)
    with pytest.raises(TypeError, match="count_saved_bytes must be a bool"):
        RunOptions(micro_batch_num=1, count_saved_bytes=1)  # type: ignore[arg-type]
