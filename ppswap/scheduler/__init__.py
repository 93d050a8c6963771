"""The pure scheduler: MetaStep IR, compute orders, lowering passes, validation.

Nothing in this package imports MindSpore or anyio: orders are plain data, built by pure
functions, so they can be printed, diffed, golden-tested and checked without running.
"""
