#!/bin/bash
# Session 10, run 3: plain block reads (shuffled / storage order) and the decode with sorted tables.
export PYTHONPATH=$PWD
python benchmarks/probe_reads.py --out $OUT > $OUT/probe_reads.log 2>&1
cat $OUT/probe_reads.log
