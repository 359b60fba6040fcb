#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.py needs on the GPU machine, which has no internet and lacks them (it has python3
# 3.12, torch, lightning, torchvision, transformers, numpy, scipy, opt-einsum and pytest): opacus, cryptography and
# cryptography's cffi and pycparser (two versions: 3.x needs Python 3.11). Downloaded with `pip download --no-deps` into the ignored folder .gpu_wheels/
# (about 10 MiB), for x86_64 Linux and CPython 3.10 to 3.12: opacus and pycparser are pure Python, cryptography has
# one abi3 wheel for all three, cffi one wheel each. pip on the GPU machine picks the one that fits:
#
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --find-links .gpu_wheels \
#         opacus cryptography cffi pycparser
#
# The versions are the ones the project's tests ran with. Usage: bash benchmarks/gpu_wheels.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python3}
dest=.gpu_wheels
mkdir -p "$dest"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
download() { "$python" -m pip download -q --no-deps --only-binary=:all: --dest "$dest" "$@"; }

download opacus==1.6.0 pycparser==3.12
download --python-version 3.10 pycparser==2.23  # pycparser 3 needs Python 3.11
download --implementation cp --python-version 3.10 --abi abi3 "${platforms[@]}" cryptography==50.0.2
for version in 3.10 3.11 3.12; do
    download --implementation cp --python-version "$version" "${platforms[@]}" cffi==2.1.1
done
ls -l "$dest"
du -sh "$dest"
