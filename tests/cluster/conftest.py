"""Fixtures of the cluster tests: the small local test image (tests/cluster/testimage)."""
from __future__ import annotations

from pathlib import Path

import pytest

TESTIMAGE_DIR = Path(__file__).parent / "testimage"


@pytest.fixture(scope="session")
def testimage(ensure_image) -> str:
    """localhost/ddp-testimage:0.1.0, built offline and imported (a no-op when unchanged)."""
    return ensure_image("localhost/ddp-testimage:0.1.0", TESTIMAGE_DIR / "Dockerfile", TESTIMAGE_DIR)
