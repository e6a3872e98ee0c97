"""Tools around prefixd, not part of the service: benchmark workloads (``workloads``), the
workload driver the benchmarks and the demo share (``driver``), and ``make demo`` (``demo``,
``demo_kill9``). Nothing in the service imports this part."""
