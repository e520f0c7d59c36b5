#!/bin/sh
# A benchmark under two source trees, alternating: before (commit BASE, checked out once into
# build/before-BASE) and after (this checkout's src/), ROUNDS times each, outputs labelled in order.
#   benchmarks/before_after.sh BASE ROUNDS PYTHON benchmarks/quantize_torch.py --repeat 7
# The source comes from PYTHONPATH, ahead of the editable install; run from the repository root.
set -eu
base=$1 rounds=$2
shift 2
tree=build/before-$base
if [ ! -d "$tree" ]; then
    mkdir -p build
    git worktree add --detach -f "$tree" "$base" >/dev/null
fi
i=1
while [ "$i" -le "$rounds" ]; do
    for side in before after; do
        if [ "$side" = before ]; then src=$tree/src; else src=$PWD/src; fi
        echo "== $side ($([ "$side" = before ] && echo "$base" || git rev-parse --short HEAD)), round $i: $*"
        PYTHONPATH=$src "$@"
    done
    i=$((i + 1))
done
