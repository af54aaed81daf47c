"""``benchmarks.handover_split`` drives aqsgd's receiver with messages built by its sender code and sent with
bare gloo sends: the receiver must take them exactly as from a Transport (the benchmark checks every
tensor)."""

import math

from benchmarks.handover_split import SYSTEMS, measure


def test_every_system_delivers_and_is_timed():
    # one inline message; one larger than the first receive size (split, then inline)
    for size in (4, 200_000):
        ms = measure(size, repeats=3, rounds=1)
        assert set(ms) == set(SYSTEMS)
        assert all(math.isfinite(v) and v > 0 for v in ms.values()), ms
