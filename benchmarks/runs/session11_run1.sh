#!/bin/bash
# Session 11 run 1: cooperative stages -- bit-identity + oracle check, then the sweep against SDPA.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
pids=()
for p in tq4 turboquant_4bit_nc turboquant_k8v4 turboquant_k3v4_nc turboquant_3bit_nc tqkern_k5v3; do
  (python - "$p" > $OUT/check_$p.log 2>&1 <<'PY'
import sys
import benchmarks.runs.session11_coop_check as c
c.PRESETS = tuple(x for x in c.PRESETS if x[0] == sys.argv[1])
sys.exit(c.main())
PY
  ) &
  pids+=($!)
done
for p in ${pids[@]}; do wait $p; done
cat $OUT/check_*.log > $OUT/check_all.log; rm $OUT/check_*_*.log $OUT/check_tq4.log 2>/dev/null
grep -c "ok$" $OUT/check_all.log; grep -v "ok$" $OUT/check_all.log | head -40
timeout 330 python benchmarks/sweep_mma.py --out $OUT --hint 1 --warps 4 --coop 0 2 3 --maxnreg -1 0 2>&1 | tee $OUT/sweep.log | tail -40
