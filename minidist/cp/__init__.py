"""Context parallelism: the sequence split over a cp group, ring attention (README.md)."""
