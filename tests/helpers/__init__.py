"""Helpers of the tests, not tests: seeded inputs, brute-force oracles, a stand-in libcublasLt, a
PDL producer kernel, the split-K config pin, and the scripts the compile tests run in a
subprocess."""
