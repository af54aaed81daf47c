"""The rANS coder's layout constants, shared by :mod:`aqsgd.compress.rans` and its numba kernels (a module of
its own so that neither imports the other: the kernels load lazily, and only where numba is installed)."""

LANES = 16  # contiguous lanes of symbols, each its own rANS stream
PROB_BITS = 15  # the frequencies add up to 2**15
STATE_LOW = 1 << 16  # a state lives in [2**16, 2**32) between symbols; it moves 16 bits at a time
