"""Expert parallelism: a Mixture-of-Experts GPT's experts sharded over ep ranks, tokens moved
to them and back by a hand-written all-to-all. exchange.py: dispatch / combine (AllToAll);
strategy.py: ExpertParallel and the mesh. README.md: the chapter.
Tests: tests/test_expert_parallel.py, tests/test_ep_exact.py (tests/scripts/ep_check.py)."""
