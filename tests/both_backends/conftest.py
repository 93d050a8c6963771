"""Suites parametrized by backend: a test that takes ``backend`` runs once per framework,
``"mindspore"`` (marked ``mindspore``: skipped where MindSpore is not installed, so in the
torch lane) and ``"torch"``; each asserts what both backends' twins asserted."""

from __future__ import annotations

import pytest

BACKENDS = [pytest.param("mindspore", marks=pytest.mark.mindspore), "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name
