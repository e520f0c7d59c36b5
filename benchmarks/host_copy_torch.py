"""Why the doctor's torch snapshots live in numpy-allocated memory: copying a 64 MB float32 tensor with
``torch.clone`` against into a fresh ``np.empty`` buffer viewed by ``torch.from_numpy``.

    python benchmarks/host_copy_torch.py

Median of 7 after one warm-up, both alternating in one process.
"""

import time

import numpy as np
import torch


def main() -> None:
    t = torch.randn(4096 * 4096)

    def clone():
        return t.clone()

    def into_numpy():
        return torch.from_numpy(np.empty(t.numel(), np.float32)).copy_(t)

    times = {clone: [], into_numpy: []}
    for f in times:
        f()
    for _ in range(7):
        for f in times:
            start = time.perf_counter()
            f()
            times[f].append(time.perf_counter() - start)
    for f, ts in times.items():
        print(f"{f.__name__:12s} {1e3 * sorted(ts)[3]:7.2f} ms")


if __name__ == "__main__":
    main()
