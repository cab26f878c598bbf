"""Puts ``tests/`` on ``sys.path`` (pytest does so for a conftest's folder) so that test modules
in sub-folders can import the shared ``helpers`` module, and holds the shared fixtures."""

import logging

import pytest


@pytest.fixture
def lightning_log(caplog):
    """What Lightning's rank-zero logger prints (the callback's tables and summaries)."""
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    return caplog
