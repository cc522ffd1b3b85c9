#!/usr/bin/env bash
# One device call (2026-11-26): the two fixes of 1bdb117 measured, then the GPU tests.
set -x
export SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/*.whl
export PYTHONPATH=$SITE:$PWD DEEPSPEED=$SITE/bin/deepspeed
{ date -u; git log -1 --format=%H 2>/dev/null; nvidia-smi; python3 -c "import torch,triton,deepspeed;print(torch.__version__,torch.version.cuda,triton.__version__,deepspeed.__version__)"; } > $OUT/env.txt 2>&1
mkdir -p $OUT/profile
timeout 260 python3 bench/gpu_check.py --sizes 125m --cases 1/none --steps 10 --out $OUT/gpu_check_125m.json --profile $OUT/profile > $OUT/gpu_check_125m.log 2>&1
echo "125m exit $? at $(date -u)"
timeout 150 python3 bench/gpu_check.py --sizes 1.3b --cases 1/none --steps 10 --out $OUT/gpu_check_1.3b.json > $OUT/gpu_check_1.3b.log 2>&1
echo "1.3b exit $? at $(date -u)"
timeout 140 python3 -m pytest -m gpu tests/gpu -n 7 -v --timeout 130 -p no:cacheprovider --durations=5 > $OUT/pytest.log 2>&1
echo "pytest exit $? at $(date -u)"
tail -3 $OUT/pytest.log; tail -15 $OUT/gpu_check_125m.log $OUT/gpu_check_1.3b.log
