"""The whole suite's control-plane keys (docs/security.md): one key directory made for the test
session, found by every process the tests start through $PASSING_KEYS, and a job secret for
the workers that join through a controller ($PASSING_JOB_SECRET)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def pytest_configure(config):
    from passing_controller.keys import keygen

    directory = Path(tempfile.mkdtemp(prefix="passing-test-keys-"))
    keygen(directory / "keys")
    config._passing_keys = directory
    os.environ["PASSING_KEYS"] = str(directory / "keys")
    os.environ.setdefault("PASSING_JOB_SECRET", os.urandom(16).hex())


def pytest_unconfigure(config):
    directory = getattr(config, "_passing_keys", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
