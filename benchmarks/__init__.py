"""GPU benchmark scripts (not tests) and the one harness they share (`benchmarks.harness`: timer, device peaks,
budgeted sweeps, JSON records). Every script runs only under `main(argv)`; importing one starts no work.

    PYTHONPATH=. python3 benchmarks/bench_sparse_mla.py --help      # or: python -m benchmarks.bench_sparse_mla

The engine's end-to-end benchmark (`benchmarks.bench_engine`) is `python -m glm_dsa bench`. Figures go to
BENCHMARKS.md with their date, commit, device and command.
"""
