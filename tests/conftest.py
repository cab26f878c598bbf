"""Puts ``tests/`` on ``sys.path`` (pytest does so for a conftest's folder) so that test modules
in sub-folders can import the shared ``helpers`` module."""
