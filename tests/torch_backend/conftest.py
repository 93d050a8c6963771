"""The torch backend's tests: skipped as a whole where torch is not installed."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
