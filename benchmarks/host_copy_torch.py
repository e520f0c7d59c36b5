"""What fresh memory costs the doctor's torch taps: copying a 64 MB float32 tensor with ``torch.clone``
(fresh torch memory), into a fresh ``np.empty`` buffer viewed by ``torch.from_numpy`` (numpy asks the kernel
for huge pages), and into a buffer already written once (no page faults: the taps' scratch from the second
use on).

    python benchmarks/host_copy_torch.py [--repeats 7]

Median of ``repeats`` after one warm-up, the three alternating in one process. The difference between the
first two and the last is the price of the page faults: ``collect`` keeps its scratch for the whole call,
puts its working copies (parameters, optimizer state) in numpy memory and the update in the last step's
gradients.
"""

import argparse
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    t = torch.randn(4096 * 4096)
    warm = torch.from_numpy(np.empty(t.numel(), np.float32)).copy_(t)

    def clone():
        return t.clone()

    def into_numpy():
        return torch.from_numpy(np.empty(t.numel(), np.float32)).copy_(t)

    def into_written():
        return warm.copy_(t)

    times = {clone: [], into_numpy: [], into_written: []}
    for f in times:
        f()
    for _ in range(args.repeats):
        for f in times:
            start = time.perf_counter()
            f()
            times[f].append(time.perf_counter() - start)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, 64 MB float32")
    for f, ts in times.items():
        print(f"{f.__name__:12s} {1e3 * sorted(ts)[len(ts) // 2]:7.2f} ms")


if __name__ == "__main__":
    main()
