"""Sparse training on a schedule for PyTorch Lightning."""
