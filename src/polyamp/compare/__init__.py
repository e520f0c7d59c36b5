"""``polyamp compare``: the same workloads on every installed framework and policy, side by side."""
