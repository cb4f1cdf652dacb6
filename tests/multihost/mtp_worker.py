"""One process of a multi-process MTP run (tests/multihost/test_mtp_processes.py): joins the runtime, loads the
checkpoint's target and nextn layer on `tp,dcp` with k drafts per step, and generates greedily with the MTP
drafts and with oracle drafts right up to each draft position m (from the MTP run's own tokens); process 0 saves
each run's tokens and per-position acceptance to an .npz.

    python mtp_worker.py PORT NUM_PROCESSES PROCESS_ID DEVICES_PER_PROCESS CKPT OUT TP,DCP K

Every process prints `done` at the end.
"""

import os
import sys


def main(argv):
    port, n, pid, devices, ckpt, out, layout, k = argv
    from multihost_processes import xla_flags
    os.environ["XLA_FLAGS"] = xla_flags(int(devices))  # the parent's compile settings, this device count
    os.environ["JAX_PLATFORMS"] = "cpu"
    from glm_dsa import distributed
    assert distributed.initialize(f"127.0.0.1:{port}", int(n), int(pid), init_timeout_s=120,
                                  heartbeat_timeout_s=20)
    import numpy as np

    import glm_dsa
    from glm_dsa import ParallelConfig
    from multihost_cases import GEN_PROMPTS, NEW_TOKENS

    tp, dcp = (int(x) for x in layout.split(","))
    k = int(k)
    eng = glm_dsa.load(ckpt, parallel=ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
                       dtype="float32", max_model_len=64, progress=False, num_speculative_tokens=k)
    results = {"mtp/tokens": np.asarray(eng.generate(GEN_PROMPTS, max_new_tokens=NEW_TOKENS, stop_token_ids=[]))}
    results["mtp/acceptance"] = np.asarray(eng.last_timings["spec_acceptance_per_position"])
    ref = results["mtp/tokens"].tolist()
    for m in range(k + 1):
        def oracle(r, m=m):  # right up to draft position m, wrong after it
            right = ref[r.prompt_index][len(r.output): len(r.output) + k]
            return [t if i < m else (t + 1 + i) % eng.config.vocab_size for i, t in enumerate(right)]
        eng.spec.oracle = oracle
        results[f"oracle{m}/tokens"] = np.asarray(eng.generate(GEN_PROMPTS, max_new_tokens=NEW_TOKENS,
                                                               stop_token_ids=[]))
        results[f"oracle{m}/acceptance"] = np.asarray(eng.last_timings["spec_acceptance_per_position"])
    if distributed.is_primary():
        np.savez(out, **results)
    print("done", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
