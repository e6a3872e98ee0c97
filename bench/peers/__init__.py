"""Peers run side by side with prefixd in the benchmarks (never imported by prefixd itself)."""
