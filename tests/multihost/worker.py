"""One process of a multi-process run (tests/multihost): joins the runtime, loads the checkpoint under each
layout given, and (process 0) saves float32 logits and greedy tokens per layout to an .npz.

    python worker.py PORT NUM_PROCESSES PROCESS_ID DEVICES_PER_PROCESS CKPT OUT LAYOUT [LAYOUT ...]

LAYOUT is `tp,dcp,qrep,backend` (qrep 1/0, backend a2a/ag_rs). Every process prints `done` at the end.
"""

import os
import sys


def main(argv):
    port, n, pid, k, ckpt, out, *layouts = argv
    from multihost_processes import xla_flags
    os.environ["XLA_FLAGS"] = xla_flags(int(k))  # the parent's compile settings, this device count
    os.environ["JAX_PLATFORMS"] = "cpu"
    from glm_dsa import distributed
    assert distributed.initialize(f"127.0.0.1:{port}", int(n), int(pid), init_timeout_s=120,
                                  heartbeat_timeout_s=20)
    import jax
    import numpy as np

    import glm_dsa
    from glm_dsa import ParallelConfig
    from multihost_cases import GEN_PROMPTS, LOGIT_IDS, NEW_TOKENS

    results = {}
    for layout in layouts:
        tp, dcp, qrep, backend = layout.split(",")
        par = ParallelConfig(tensor_parallel_size=int(tp), decode_context_parallel_size=int(dcp),
                             dcp_q_replicate=qrep == "1", dcp_comm_backend=backend)
        eng = glm_dsa.load(ckpt, parallel=par, dtype="float32", max_model_len=64, progress=False)
        # FP8 weights kept as such (a release's own form), each process having read only its devices' slices
        results[f"{layout}/fp8_leaves"] = np.asarray(sum(str(a.dtype) == "float8_e4m3fn"
                                                         for a in jax.tree_util.tree_leaves(eng.params)))
        results[f"{layout}/logits"] = eng.logits(np.asarray(LOGIT_IDS))
        gen = eng.generate(GEN_PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        results[f"{layout}/tokens"] = np.asarray(gen)
    if distributed.is_primary():
        np.savez(out, **results)
    print("done", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
