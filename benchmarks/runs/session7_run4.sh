# Session 7, run 4: the same commands as run 3, after the 3-bit Lloyd-Max output-scale fix.
bash "$(dirname "$0")/session7_run3.sh"
