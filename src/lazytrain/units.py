"""Units shared by every part of LazyTrain: one definition each, no torch, no solver.

Sizes are int bytes and rates bytes/s inside the code; a GB is decimal (1e9 bytes), as in
the vendor datasheets and every `_gb` / `_gb_per_s` config key, never 2**30.
"""

GB = 1e9
"""Bytes per gigabyte (decimal): `size_bytes / GB` is GB, `rate_bytes_per_s / GB` is GB/s."""
