"""The whole system on one machine: local Ray clusters on free ports, a stack of registry,
artifacts and controller on them, a cluster of several nodes, the load generator, and the
``rollout demo`` command that drives them all.

For the demo, the tests and the benchmarks; nothing that runs in a production cluster imports
this package (tests/unit/test_layering.py checks it).
"""
