"""GPU benchmarks (not tests): one suite of per-area benchmarks and the harness they share.

    python -m benchmarks suite [--only AREA,...] [--out DIR]   # every area; writes benchmarks/results/AREA.json
    python -m benchmarks render                                 # BENCHMARKS.md's tables from those files
    PYTHONPATH=. python3 benchmarks/bench_sparse_mla.py --help  # one benchmark (or python -m benchmarks.bench_...)

`benchmarks.suite` runs the areas, `benchmarks.render` the tables, `benchmarks.harness` is the timer, device peaks,
budgeted sweeps and JSON record every benchmark uses. Every script runs only under `main(argv)`; importing one
starts no work. The end-to-end benchmark is the package's (`glm_dsa.serving.benchmark`, `python -m glm_dsa bench`).
"""
