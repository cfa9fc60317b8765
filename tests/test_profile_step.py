"""benchmarks/profile_step.py's frontier_advance: what each kernel adds to the end of the GPU's
work, on made-up kernel intervals (µs) whose answer is worked out by hand, and on random ones (a
fresh seed each run, named on failure) against the busy time it must sum to."""
import random

from benchmarks.profile_step import _busy_us, frontier_advance


def test_early_started_kernels_count_only_what_they_add():
    # b starts early (as a PDL kernel's programs do) and ends 2 past a; c runs alone after a gap;
    # d lies wholly inside c.
    kernels = [("a", 0.0, 10.0), ("b", 1.0, 12.0), ("c", 15.0, 20.0), ("d", 16.0, 18.0)]
    assert frontier_advance(kernels) == {"a": (1, 10.0), "b": (1, 2.0), "c": (1, 5.0), "d": (1, 0.0)}


def test_names_gather_and_the_advances_sum_to_the_busy_time():
    seed = random.randrange(2 ** 32)
    rng = random.Random(seed)
    kernels = []
    for i in range(200):
        start = rng.uniform(0, 1000)
        kernels.append((f"k{i % 7}", start, start + rng.uniform(0, 30)))
    advances = frontier_advance(kernels)
    assert sum(n for n, _ in advances.values()) == 200, seed
    assert abs(sum(t for _, t in advances.values()) - _busy_us((s, e) for _, s, e in kernels)) < 1e-6, seed
