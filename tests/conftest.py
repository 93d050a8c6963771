"""Shared fixtures: deterministic MindSpore set-up for every test."""

from __future__ import annotations

import mindspore as ms
import pytest


@pytest.fixture(autouse=True, scope="session")
def _pynative() -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
