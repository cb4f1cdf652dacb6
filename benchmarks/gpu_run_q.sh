#!/usr/bin/env bash
# Session 9, call Q (then R): the Mosaic sparse MLA kernel with the cp.async producer (issue 17); R adds stagger and diagnostics.
set -x
cd "$(dirname "$0")/.."
export PYTHONPATH=.
timeout 300 python3 benchmarks/probe_sparse_mla_mosaic.py --out $OUT/probe.json --variants cp_async,stagger,diag_no_mask,diag_gather_only --batches 128,32,1 > $OUT/probe.log 2>&1
echo rc=$?
MOSAIC_GPU_DUMP_PTXAS=1 timeout 100 python3 -c "
import jax, jax.numpy as jnp, numpy as np
from kernels import sparse_mla_mosaic as m
q=jnp.zeros((2,64,576),jnp.bfloat16); c=jnp.zeros((4096,576),jnp.bfloat16); i=jnp.zeros((2,128),jnp.int32)
jax.block_until_ready(m.sparse_mla_mosaic(q,c,i,scale=0.1,kv_lora_rank=512,n_split=1))
" > $OUT/ptxas.log 2>&1
grep -i "spill\|registers\|error" $OUT/ptxas.log | head -20
grep PROBE $OUT/probe.log | cut -c1-1500
tail -30 $OUT/probe.log | cut -c1-400
