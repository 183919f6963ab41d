"""The GPU benchmarks of tqkern's ops, as a package: what ``tqkern bench`` and the
``benchmarks/bench_*.py`` entries run.

* :mod:`~tqkern_torch.bench.shapes`: named, model-like shapes (shared with the tests).
* :mod:`~tqkern_torch.bench.report`: the JSON schema, table, plot and progress bar (no torch,
  no GPU: CI tests them on fake records).
* :mod:`~tqkern_torch.bench.timing`: CUDA-graph and eager timers, the CUDA-device check.
* :mod:`~tqkern_torch.bench.decode`, :mod:`~tqkern_torch.bench.store`: one runner per op, each a
  correctness gate against the NumPy oracle, then timings against a torch baseline of the same run.
* :mod:`~tqkern_torch.bench.runner`: which presets and shapes a run covers, and the run itself.
* :mod:`~tqkern_torch.bench.generate`: end to end, ``model.generate`` of a Llama-3-8B-shaped
  model through a TQCache against transformers' SDPA + DynamicCache (``tqkern bench generate``).

The runners live here, in an installed package, rather than in ``benchmarks/`` (not installed),
so that ``tqkern bench`` works from any directory after ``pip install``.
"""
