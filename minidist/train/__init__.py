"""Data, checkpoints, the memory ledger, and the training loop shared by every strategy.

Tests: tests/test_data.py, tests/test_checkpoint.py, tests/test_checkpoint_dirs.py,
tests/test_memory.py, tests/test_train.py.
"""
