"""Parallel strategies, one file each: ddp.py (data parallelism; ZeRO, tensor and pipeline
parallelism land beside it)."""
