"""What every strategy package builds on: the Strategy base, the checkpoint format, the
memory ledger (minidist/strategy/README.md)."""
