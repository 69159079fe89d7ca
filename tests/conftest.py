"""Shared fixtures. Importing refusion_mlx first lets it preload an optimized BLAS."""

import json
from pathlib import Path

import refusion_mlx  # noqa: F401  (before mlx.core)
import numpy as np
import pytest

from refusion_mlx.models.loading import load

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def demo():
    """The golden fixture model (the demo model the reference decoded) in float32."""
    return load(FIXTURES / "tiny-refusion", dtype="float32")


@pytest.fixture(scope="session")
def golden_cases():
    return json.loads((FIXTURES / "golden_outputs.json").read_text())


@pytest.fixture(scope="session")
def golden_logits():
    return dict(np.load(FIXTURES / "golden_logits.npz"))
