# Session 8: GPU check after the residency caches were re-keyed (both kernels' split rules).
export PYTHONPATH=$PWD
timeout 200 python -m pytest -q tests/test_gpu_decode.py -k "graph or 64k" tests/test_decode_launch.py -p no:cacheprovider > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -2 $OUT/pytest.log
SKIP_PYTEST=1 bash benchmarks/runs/session8_check.sh 2>&1 | tail -1
python - <<'PY'
import torch
from tqkern_torch.attention import paged_decode
from tqkern.ops.paged_decode import triton_mma as tm
from benchmarks.bench_decode import make_layout
layout, params = make_layout("tq4", "row", 8, 128)  # B32x16K shapes, one real block
q = torch.randn(32, 32, 128, device="cuda", dtype=torch.float16)
paged_decode(q, torch.zeros(layout.cache_shape(1), dtype=torch.uint8, device="cuda"),
             torch.zeros(32, 1024, device="cuda", dtype=torch.int32), torch.full((32,), 16, dtype=torch.int32, device="cuda"),
             layout, params)
torch.cuda.synchronize()
res = list(tm._RESIDENT.values())
print("tq4 B32x16K: resident warps", res, "-> splits", tm.num_splits_mma(32, 8, 16384, res[0]))
PY
