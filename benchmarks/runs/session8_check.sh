# Session 8: GPU check after the residency helper was shared by both kernels' split rules.
export PYTHONPATH=$PWD
[ -n "$SKIP_PYTEST" ] || timeout 250 python -m pytest -q tests/test_decode_launch.py tests/test_gpu_decode.py -p no:cacheprovider > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -3 $OUT/pytest.log
python - <<'PY'
import torch
from tqkern_torch.attention import paged_decode
from tqkern.ops.paged_decode import triton as pdt
from benchmarks.bench_decode import make_layout
layout, params = make_layout("fp16", "slot", 8, 128)  # B8x64K shapes, one real block
q = torch.randn(8, 32, 128, device="cuda", dtype=torch.float16)
bt = torch.zeros(8, 4096, device="cuda", dtype=torch.int32)
sl = torch.full((8,), 16, dtype=torch.int32, device="cuda")
cache = torch.zeros(layout.cache_shape(1), dtype=torch.uint8, device="cuda")
paged_decode(q, cache, bt, sl, layout, params)
torch.cuda.synchronize()
res = list(pdt._RESIDENT_CTAS.values())
sms = torch.cuda.get_device_properties(0).multi_processor_count
print("fp16 B8x64K: resident programs", res, "-> splits", pdt.num_splits_for(8, 8, 65536, sms, 64, resident_ctas=res[0]))
PY
