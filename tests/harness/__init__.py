"""Harnesses of the tests and benchmarks (not shipped with fullshard): a sharded run against a
one-process reference (`compare`), the same for VLMs (`vlm_parity`), the memory estimate against
FSDPMemTracker (`memory_matrix`)."""
