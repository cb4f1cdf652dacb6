"""GPU diagnostics: probes of kernel variants and launch configs, breakdowns of where an op's time goes, and the
timing-only forms of the kernels they need (`sparse_mla_forms`). Not part of the benchmark suite's figures: each
script prints and writes its own rows for a question about one kernel.

    PYTHONPATH=. python3 -m benchmarks.diagnostics.probe_sparse_mla_mosaic --help
"""
