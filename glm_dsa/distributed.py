"""Several hosts: JAX's multi-controller runtime, one process per host and one mesh over every process's devices.

Call `initialize(...)` (or `jax.distributed.initialize` yourself) before anything touches a device; then
`glm_dsa.load(...)` in every process builds the mesh over all processes' devices, each process reads only the
checkpoint bytes of its own devices' shards, and `Engine.logits` / `Engine.generate` return the same results in
every process. Host-side scheduling runs identically in every process: the inputs are the same and every decision
is a deterministic function of them (no clocks, no randomness outside the seeded sampler), so no broadcast is needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import threading
import time

import jax

#: The environment variables JAX documents for its multi-controller runtime, read when no argument is given.
ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the coordinator listens and who this process is; checked on construction.

    init_timeout_s: how long every process waits for all of them to join before it exits with an error naming
    the coordinator; heartbeat_timeout_s: how soon the survivors stop (JAX's coordination service aborts them with
    a message naming the unhealthy task) after a process dies mid-run.
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    init_timeout_s: int = 300
    heartbeat_timeout_s: int = 60

    def __post_init__(self):
        if not isinstance(self.coordinator_address, str) or not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}",
                                                                               self.coordinator_address):
            raise ValueError(f"coordinator_address must be HOST:PORT, got {self.coordinator_address!r}")
        for name in ("num_processes", "init_timeout_s", "heartbeat_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        p = self.process_id
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_processes:
            raise ValueError(f"process_id must be an integer in [0, num_processes={self.num_processes}), got {p!r}")

    @classmethod
    def from_args(cls, coordinator_address=None, num_processes=None, process_id=None, **timeouts):
        """The config from arguments, each falling back to its JAX_* environment variable; None when none of the
        three is given anywhere (a single process). Some but not all of them is a ValueError naming the rest."""
        given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
                 "process_id": process_id}
        for name, var in ENV.items():
            if given[name] is None and os.environ.get(var):
                raw = os.environ[var]
                try:
                    given[name] = raw if name == "coordinator_address" else int(raw)
                except ValueError:
                    raise ValueError(f"environment variable {var} must be an integer, got {raw!r}") from None
        missing = [n for n, v in given.items() if v is None]
        if len(missing) == 3:
            return None
        if missing:
            raise ValueError(f"a multi-process run needs coordinator_address, num_processes and process_id; "
                             f"missing {missing} (arguments or {[ENV[m] for m in missing]})")
        return cls(**given, **timeouts)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, init_timeout_s: int = 300, heartbeat_timeout_s: int = 60) -> bool:
    """Join the multi-controller runtime (see `DistributedConfig`); True if this is a multi-process run.

    With none of the three given (arguments or JAX_* variables), or a single process, nothing happens. Must run
    before anything touches a device. A peer that never joins ends this process after `init_timeout_s` with one
    line naming the coordinator and the process count (exit status 1), not a hang."""
    cfg = DistributedConfig.from_args(coordinator_address, num_processes, process_id,
                                      init_timeout_s=init_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s)
    if cfg is None or cfg.num_processes == 1:
        return False
    if jax.distributed.is_initialized():
        if jax.process_count() != cfg.num_processes or jax.process_index() != cfg.process_id:
            raise ValueError(f"the JAX runtime is already initialised as process {jax.process_index()} of "
                             f"{jax.process_count()}, not {cfg.process_id} of {cfg.num_processes}")
        return True
    # CPU devices talk over gloo (the default has no cross-process collectives); a GPU backend ignores this
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    def give_up():
        # JAX's own deadline ends the process with a bare 'Deadline Exceeded'; say what was waited for first
        print(f"error: glm_dsa.distributed: not all {cfg.num_processes} processes joined the coordinator at "
              f"{cfg.coordinator_address} within {cfg.init_timeout_s} s (this is process {cfg.process_id}); "
              "start every process with the same --coordinator-address and --num-processes", file=sys.stderr,
              flush=True)
        os._exit(1)

    watchdog = threading.Timer(max(cfg.init_timeout_s - 1, 0.5), give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(cfg.coordinator_address, cfg.num_processes, cfg.process_id,
                                   initialization_timeout=cfg.init_timeout_s,
                                   heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    finally:
        watchdog.cancel()
    return True


def is_primary() -> bool:
    """Whether this is process 0: the one that prints the CLI's output and answers HTTP."""
    return jax.process_index() == 0


def add_flags(p: argparse.ArgumentParser) -> None:
    """The command line's flags of a multi-process run (`generate`, `serve`, `convert`, `bench`, `trace`)."""
    g = p.add_argument_group("several hosts (JAX's multi-controller runtime: one process per host; the JAX_* "
                             "environment variables work too)")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's address, the same for every process (JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int, default=None, help="processes in all (JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, help="this process, 0..N-1 (JAX_PROCESS_ID)")
    g.add_argument("--distributed-timeout", type=int, default=300, metavar="S",
                   help="seconds to wait for every process to join before giving up with an error")
    g.add_argument("--distributed-heartbeat-timeout", type=int, default=60, metavar="S",
                   help="seconds after which a process that stopped answering (died) ends the others")


def initialize_from_flags(args: argparse.Namespace) -> bool:
    """`initialize` with the `add_flags` flags of parsed `args`; True if this is a multi-process run."""
    return initialize(args.coordinator_address, args.num_processes, args.process_id,
                      init_timeout_s=args.distributed_timeout, heartbeat_timeout_s=args.distributed_heartbeat_timeout)


def is_multiprocess() -> bool:
    """Whether this process is one of several in JAX's multi-controller runtime."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


def check_mesh_spans_processes(mesh: jax.sharding.Mesh) -> None:
    """A ValueError unless every process holds at least one of `mesh`'s devices. A process left out has nothing
    to run its part of the program on (and would wait at JAX's shutdown for the others), so every process says
    so at once: the mesh takes the first tensor_parallel_size devices in process order."""
    have = {d.process_index for d in mesh.devices.flat}
    missing = sorted(set(range(jax.process_count())) - have)
    if missing:
        raise ValueError(f"the mesh of {mesh.devices.size} devices leaves out processes {missing} of "
                         f"{jax.process_count()} ({jax.device_count()} devices in all, {jax.local_device_count()} in "
                         "this process): across processes tensor_parallel_size must use every process's devices "
                         f"(e.g. -tp {jax.device_count()})")


#: where a failing process reports its exit in the runtime's key-value store: EXIT_PREFIX/<process index>
EXIT_PREFIX = "glm_dsa/exit"


def exit_now(status: int, *, wait_s: float = 10.0) -> None:
    """End this process with `status` at once, skipping JAX's shutdown barrier. A process that fails in a
    multi-process run must not wait there: its peers are inside a collective that needs it, and only its absence
    (the coordination service's heartbeat, `--distributed-heartbeat-timeout`) ends them with an error.

    Process 0 hosts the coordination service, so a peer still alive when it goes loses the service and JAX aborts
    it (SIGABRT, not `status`): when every process fails the same way (a bad flag, a mesh that leaves a process
    out) that race decided which status each one ended with. So every other process reports its exit in the
    key-value store (EXIT_PREFIX/<index>) before it goes, and process 0 waits for those reports (at most
    `wait_s`: a peer still busy in a collective never sends one) and a moment more before it goes."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        _report_exit(status, wait_s)
    except Exception:  # noqa: BLE001 - the runtime may be half gone already: exiting is all that is left to do
        pass
    os._exit(status)


def _report_exit(status: int, wait_s: float) -> None:
    """The exit handshake of `exit_now` (nothing outside a multi-process run)."""
    from jax._src import distributed as jax_distributed  # jax has no public key-value store (as serving.lockstep)
    client = jax_distributed.global_state.client
    if client is None or not is_multiprocess():
        return
    me = jax.process_index()
    if me != 0:
        client.key_value_set(f"{EXIT_PREFIX}/{me}", str(status), allow_overwrite=True)
        return
    deadline = time.monotonic() + wait_s
    for peer in range(1, jax.process_count()):
        left_ms = int(1000 * (deadline - time.monotonic()))
        if left_ms <= 0:
            return
        try:
            client.blocking_key_value_get(f"{EXIT_PREFIX}/{peer}", left_ms)
        except Exception:  # noqa: BLE001 - not reported in time: a peer still at work, which the heartbeat ends
            return
    time.sleep(0.2)  # the last peer's report is in: let it finish its own exit before the service goes
