"""Modules that moved keep working from their old paths, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

MOVED = {
    "ppswap.actors.faults": ("ppswap.core.faults", "FaultPlan"),
    "ppswap.swap.device": ("ppswap.backends.cpu_engine", "EmulatedDevice"),
    "ppswap.autograd": ("ppswap.backends.mindspore.autograd", None),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_warns_and_still_serves_its_names(old: str) -> None:
    new, name = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    if name is not None:
        assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_the_old_autograd_functions_still_record_and_run_backwards_in_any_order() -> None:
    sys.modules.pop("ppswap.autograd", None)
    with pytest.warns(DeprecationWarning):
        old = importlib.import_module("ppswap.autograd")
    ms.set_seed(0)
    block = nn.Dense(4, 4)
    weights = block.trainable_params()

    def forward(x: Tensor) -> Tensor:
        out: Tensor = block(x)
        return out

    xs = [Tensor(np.full((2, 4), v, np.float32)) for v in (1.0, 2.0)]
    outs = [old.record_forward(forward, (x,)) for x in xs]
    sens = Tensor(np.ones((2, 4), np.float32))
    second = old.run_backward(forward, (xs[1],), weights, sens)  # FIFO order broken on purpose
    first = old.run_backward(forward, (xs[0],), weights, sens)
    assert len(outs) == 2 and len(first[1]) == len(second[1]) == len(weights)
    assert not np.array_equal(first[1][0].asnumpy(), second[1][0].asnumpy())


def test_size_class_still_serves_from_the_cpu_engine_with_a_warning() -> None:
    cpu_engine = importlib.import_module("ppswap.backends.cpu_engine")
    host_memory = importlib.import_module("ppswap.backends.host_memory")
    with pytest.warns(DeprecationWarning, match=r"ppswap\.backends\.host_memory"):
        moved = cpu_engine.size_class
    assert moved is host_memory.size_class
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = cpu_engine.no_such_name
