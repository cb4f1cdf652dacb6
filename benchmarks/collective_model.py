"""The modelled cost of the step's collectives on one 8-GPU NVLink node, from published nccl-tests figures.

One device's time of a collective of kind K over a group of n devices on B bytes (`sharding.CollectiveCall`: the
calls the step records while tracing):

    t = latency + factor(K, n) * S / bus_bandwidth

with nccl-tests' bus-bandwidth convention (its doc/PERFORMANCE.md): S and the factor are those that make the bus
bandwidth the bytes one link carries, for the ring algorithm: psum (all-reduce) 2 (n - 1) / n of the buffer,
all_gather (n - 1) / n of the gathered output, psum_scatter (n - 1) / n of the input, all_to_all (n - 1) / n of
the buffer. The all-reduce takes the NVLink SHARP bus bandwidth (NCCL's default all-reduce on 8 NVSwitch GPUs).
The inputs (bandwidths, latency) live in one table with their sources, benchmarks/inputs/collective_model.json;
its `measured` list ({"kind", "group", "bytes", "us"} points of a multi-GPU run) replaces the model for the kind
and group size it covers (log-log interpolation between points, the nearest point's bandwidth beyond them).
A group of 1 costs nothing (XLA removes it).
"""

from __future__ import annotations

import bisect
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
INPUTS = os.path.join(HERE, "inputs", "collective_model.json")
KINDS = ("psum", "all_gather", "psum_scatter", "all_to_all")


def load_inputs(path: str = INPUTS) -> dict:
    """The model's inputs: {"values": {name: value}, "sources": {name: source}, "measured": [...]}."""
    with open(path) as f:
        raw = json.load(f)
    return {"values": {i["name"]: i["value"] for i in raw["inputs"]},
            "sources": {i["name"]: i["source"] for i in raw["inputs"]}, "measured": raw.get("measured", [])}


def wire_bytes(kind: str, group: int, in_bytes: int, out_bytes: int) -> float:
    """The bytes the ring algorithm moves through one device's link for a call (nccl-tests' bus-bandwidth factor
    times its size convention)."""
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r}: one of {KINDS}")
    n = group
    if kind == "psum":
        return 2 * (n - 1) / n * in_bytes
    if kind == "all_gather":
        return (n - 1) / n * out_bytes
    return (n - 1) / n * in_bytes  # psum_scatter: the input; all_to_all: the buffer


def _measured_us(points: list[dict], kind: str, group: int, size: int) -> float | None:
    pts = sorted((p["bytes"], p["us"]) for p in points if p["kind"] == kind and p["group"] == group)
    if not pts:
        return None
    sizes = [b for b, _ in pts]
    i = bisect.bisect_left(sizes, size)
    if i < len(pts) and sizes[i] == size:
        return pts[i][1]
    if i == 0:
        return pts[0][1]  # below the smallest point: its time (the latency floor)
    if i == len(pts):
        b, us = pts[-1]
        return us * size / b  # beyond the largest: its bandwidth
    (b0, t0), (b1, t1) = pts[i - 1], pts[i]
    w = (math.log(size) - math.log(b0)) / (math.log(b1) - math.log(b0))
    return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))


def collective_us(kind: str, group: int, in_bytes: int, out_bytes: int, inputs: dict | None = None) -> float:
    """Modelled microseconds of one call (see the module doc); measured figures first where the inputs have them."""
    if group <= 1:
        return 0.0
    inputs = inputs or load_inputs()
    size = in_bytes if kind != "all_gather" else out_bytes
    got = _measured_us(inputs["measured"], kind, group, size)
    if got is not None:
        return got
    v = inputs["values"]
    bw = v["allreduce_busbw_gb_s"] if kind == "psum" else v["busbw_gb_s"]
    return v["latency_us"] + wire_bytes(kind, group, in_bytes, out_bytes) / (bw * 1e9) * 1e6


def call_us(call, inputs: dict | None = None) -> float:
    """`collective_us` of a recorded `sharding.CollectiveCall`."""
    return collective_us(call.kind, call.group, call.in_bytes, call.out_bytes, inputs)


def sources(inputs: dict | None = None) -> list[str]:
    """The sources of the model's inputs, one line each."""
    inputs = inputs or load_inputs()
    return [f"{name} = {inputs['values'][name]}: {src}" for name, src in inputs["sources"].items()]


def main(argv=None) -> int:
    """Print the model's inputs with their sources, and the modelled time of one call (`--kind`, `--group`,
    `--bytes`: the local input's bytes; an all-gather's output is `group` times it)."""
    import argparse
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=KINDS, default="psum")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--bytes", type=int, default=16 * 6144 * 2, help="the local input's bytes")
    args = p.parse_args(argv)
    inputs = load_inputs()
    for line in sources(inputs):
        print(line)
    out = args.bytes * args.group if args.kind == "all_gather" else args.bytes
    print(f"{args.kind} of {args.bytes} B over {args.group} devices: "
          f"{collective_us(args.kind, args.group, args.bytes, out, inputs):.2f} us")
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
