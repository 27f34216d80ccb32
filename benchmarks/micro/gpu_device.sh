#!/bin/bash
# One run on a lent GPU machine (the `device` tool) for issue 16, item 5:
# the CUDA tests (marked gpu), then `benchmarks.micro.gpu` at 4 GiB. Prepared so one call does it all.
#
# Here, once (the device machine has torch, numpy, tqdm, pytest and hypothesis,
# not zstandard or blake3; its python3 is 3.12):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl zstandard==0.25.0 blake3==1.0.11
# Then: run(command="bash benchmarks/micro/gpu_device.sh", carry=[".whl"], timeout_s=420)
# Results come back under $OUT (tests.txt, gpu_4gib.txt, gpu_4gib.json).
set -o pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
${PY:-python3} -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
timeout 150 ${PY:-python3} -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_repository.py tests/test_loading.py tests/test_dcp.py tests/test_dcp_replicated.py 2>&1 | tee "$OUT/tests.txt"
timeout 240 ${PY:-python3} -m benchmarks.micro.gpu --gib ${GIB:-4} --rounds 2 --dir /tmp --json "$OUT/gpu_4gib.json" 2>&1 | tee "$OUT/gpu_4gib.txt"
