"""Confidence intervals for small sets: Wilson's score interval for one proportion, Newcombe's hybrid
(method 10, from the two Wilson intervals) for the difference of two. z = 1.96: 95 %."""
import math

Z95 = 1.96


def wilson(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = passed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def difference(passed_b: int, n_b: int, passed_a: int, n_a: int, z: float = Z95) -> tuple[float, float, float]:
    """B - A as (delta, low, high)."""
    pa, pb = (passed_a / n_a if n_a else 0.0), (passed_b / n_b if n_b else 0.0)
    la, ua = wilson(passed_a, n_a, z)
    lb, ub = wilson(passed_b, n_b, z)
    delta = pb - pa
    return delta, delta - math.sqrt((pb - lb) ** 2 + (ua - pa) ** 2), delta + math.sqrt((ub - pb) ** 2 + (pa - la) ** 2)
