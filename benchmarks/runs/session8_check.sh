# Session 8: GPU check after the residency helper was shared by both kernels' split rules.
export PYTHONPATH=$PWD
timeout 250 python -m pytest -q tests/test_decode_launch.py tests/test_gpu_decode.py -p no:cacheprovider > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -3 $OUT/pytest.log
python - <<'PY'
import torch, tqkern, tqkern_torch as tqt
from tqkern.ops.paged_decode import triton as pdt
from benchmarks.bench_decode import make_layout
for preset, arr in (("fp16", "slot"), ("tq4", "row")):
    layout, params = make_layout(preset, arr, 8, 128)
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.float16)
    bt = torch.arange(8 * 4096, device="cuda", dtype=torch.int32).reshape(8, 4096)
    sl = torch.full((8,), 65536, dtype=torch.int32, device="cuda")
    cache = torch.zeros(layout.cache_shape(16), dtype=torch.uint8, device="cuda")
    print(preset, "resident", dict(pdt._RESIDENT_CTAS) and list(pdt._RESIDENT_CTAS.values()),
          "splits B8x64K:", pdt.num_splits_for(8, 8, 65536, 132, 64, resident_ctas=396))
PY
