"""One process of a two-process prefix-caching run (tests/multihost/test_prefix_processes.py): joins the runtime,
loads the checkpoint on `tp,dcp` with prefix caching on, generates two turns of a chat whose prompts share pages,
and saves its own tokens and prefix-cache counters to OUT_<process id>.npz (each process its own: the matches
must be the same everywhere).

    python prefix_worker.py PORT NUM_PROCESSES PROCESS_ID DEVICES_PER_PROCESS CKPT OUT TP,DCP

Every process prints `done` at the end.
"""

import os
import sys


def main(argv):
    port, n, pid, devices, ckpt, out, layout = argv
    from multihost_processes import xla_flags
    os.environ["XLA_FLAGS"] = xla_flags(int(devices))  # the parent's compile settings, this device count
    os.environ["JAX_PLATFORMS"] = "cpu"
    from glm_dsa import distributed
    assert distributed.initialize(f"127.0.0.1:{port}", int(n), int(pid), init_timeout_s=120,
                                  heartbeat_timeout_s=20)
    import numpy as np

    import glm_dsa
    from glm_dsa import ParallelConfig
    from multihost_cases import PREFIX_NEW_TOKENS, prefix_turns

    tp, dcp = (int(x) for x in layout.split(","))
    eng = glm_dsa.load(ckpt, parallel=ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
                       dtype="float32", max_model_len=64, block_size=4, progress=False)
    tokens = prefix_turns(eng, PREFIX_NEW_TOKENS)
    m = eng.metrics()
    np.savez(f"{out}_{pid}.npz", tokens=np.asarray(tokens, dtype=object),
             counters=np.asarray([m["prefix_cache_queries"], m["prefix_cache_hits"], m["prefix_cache_pages"]]))
    print("done", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
