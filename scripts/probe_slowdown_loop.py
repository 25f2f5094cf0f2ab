"""The pure-Python loop scripts/probe_slowdown.py times, in its own process
and in a fresh interpreter (this module alone: nothing else imported)."""
import time


def py_loop_ms():
    """Best of 5 runs of a 200,000-step integer loop, in milliseconds."""
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        s = 0
        for i in range(200_000):
            s += i * i
        best = min(best, time.perf_counter() - t)
    return best * 1e3
