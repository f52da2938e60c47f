"""Fixtures of the fault suite: a tagged job environment that is cleaned up whatever happens."""
from __future__ import annotations

import pytest

import _fault_kit as kit

TIMEOUT, CONNECT_TIMEOUT = kit.TIMEOUT, kit.CONNECT_TIMEOUT


@pytest.fixture
def fault(tmp_path):
    job = kit.FaultJob(tmp_path)
    yield job
    job.cleanup()

