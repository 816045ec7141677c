"""Shared by the BPE tests (tests/test_bpe.py, tests/test_bpe_train.py): GPT-2's byte table,
byte -> printable character."""
from minidist.train.bpe import bytes_to_unicode


B2U = bytes_to_unicode()
