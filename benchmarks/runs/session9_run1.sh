# Session 9 run 1: byte-permute lookups (K_PRMT / V_PRMT) in the warp-MMA kernel, oracle-gated.
export PYTHONPATH=$PWD
python benchmarks/sweep_mma.py --out $OUT/tq4 --presets tq4 --prefetch 1 --hint 1 --warps 4 \
  --prmt 0,0 1,0 2,0 4,0 0,1 1,1 2,1 0,2 > $OUT/sweep_tq4.log 2>&1
echo "tq4 rc $?"; tail -22 $OUT/sweep_tq4.log
python benchmarks/sweep_mma.py --out $OUT/nc --presets turboquant_4bit_nc --prefetch 1 --hint 1 --warps 4 \
  --prmt 0,0 1,0 2,0 > $OUT/sweep_nc.log 2>&1
echo "nc rc $?"; tail -8 $OUT/sweep_nc.log
