"""acquire()+release() cost at 4, 40 and 400 replicas of one model.

Each pool also holds 4,000 replicas of other models, to show that they cost
nothing, and keeps half of the model's replicas busy so that the buckets are
not trivially all at zero. Reports the best of several rounds (ns per pair).
"""

from __future__ import annotations

import argparse
import json
import time

from router.core.config.settings import ReplicaConfig
from router.core.pool.pool import Pool

SIZES = (4, 40, 400)


def pool_of(n: int, others: int) -> Pool:
    configs = [ReplicaConfig(f"m-{i}", "m", f"http://127.0.0.1:{10000 + i}") for i in range(n)]
    configs += [ReplicaConfig(f"o-{i}", f"other-{i % 50}", f"http://127.0.0.2:{10000 + i}") for i in range(others)]
    pool = Pool(configs)
    for _ in range(n // 2):
        pool.acquire("m")
    return pool


def measure(n: int, *, others: int = 4000, pairs: int = 100_000, rounds: int = 5) -> float:
    pool = pool_of(n, others)
    acquire, release = pool.acquire, pool.release
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter_ns()
        for _ in range(pairs):
            replica = acquire("m")
            assert replica is not None
            release(replica)
        best = min(best, (time.perf_counter_ns() - began) / pairs)
    return best


def main() -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {str(n): measure(n, pairs=args.pairs) for n in SIZES}
    if args.json:
        print(json.dumps(results))
    else:
        base = results["4"]
        for n, ns in results.items():
            print(f"{n:>4} replicas: {ns:7.0f} ns per acquire+release ({ns / base:.2f}x of 4)")
    return results


if __name__ == "__main__":
    main()
