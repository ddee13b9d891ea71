"""benchmarks/serving.py's goal check: autoprec's plan at least as accurate as a peer's at equal estimated time, and
faster at equal accuracy.

Both sides are deterministic (an estimated time from the cost model, an error measured on fixed data), so there is
no spread to call a tie inside: two figures are *equal* when they differ by at most ``TOLERANCE`` (1%) of the larger.
"""

from __future__ import annotations

TOLERANCE = 0.01


def same(a: float, b: float, tolerance: float = TOLERANCE) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def goal_verdict(ours: tuple[float, float], peer: tuple[float, float], tolerance: float = TOLERANCE) -> str:
    """Compare (time, error) pairs, lower better in both:

    - ``tie``: equal time and equal error;
    - ``holds``: at equal time ours is more accurate, at equal accuracy ours is faster, or ours is both;
    - ``fails``: at equal time ours is less accurate, at equal accuracy slower, or the peer's is both;
    - ``trade-off``: ours faster and less accurate, or slower and more accurate (neither is at equal time nor at
      equal accuracy, so the goal is not tested by this pair).
    """
    time_same, error_same = same(ours[0], peer[0], tolerance), same(ours[1], peer[1], tolerance)
    if time_same and error_same:
        return "tie"
    faster, more_accurate = ours[0] < peer[0], ours[1] < peer[1]
    if time_same:
        return "holds" if more_accurate else "fails"
    if error_same:
        return "holds" if faster else "fails"
    if faster == more_accurate:
        return "holds" if faster else "fails"
    return "trade-off"
