"""BENCHMARKS.md's tables, rendered from benchmarks/results/*.json: no figure in BENCHMARKS.md is typed by hand.

    python -m benchmarks render           # rewrite the marked regions
    python -m benchmarks render --check   # exit 1 if BENCHMARKS.md is out of date with the JSON

A table sits between `<!-- table:NAME -->` and `<!-- /table -->` (NAME a key of `TABLES`); everything between the
two markers is replaced. Each table starts with where its figures come from: device, jax version, date, commit and
the command of the results file, or of each of its `sources` where the file was put together from several runs
(then every row names its source, `source`, an index into that list or a list of them for a row made of several
runs, and the table has a "run" column). A record whose rows were recomputed later from its own measurements
(`reprojected`: date, commit, command) says so on a second line, as does one whose rows were read back from the
run's printed log (`rebuilt`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
DOCS = (os.path.join(REPO, "BENCHMARKS.md"), os.path.join(REPO, "README.md"))
_REGION = re.compile(r"(<!-- table:(?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def fmt(x) -> str:
    """A cell: floats to 4 significant digits (whole numbers from 10000), None as an em dash, dicts and lists as compact JSON."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.0f}" if abs(x) >= 1e4 else f"{x:.4g}"  # no exponent for large figures
    if isinstance(x, (dict, list)):
        return json.dumps(x, separators=(",", ":"))
    return str(x)


def ratio(num: str, den: str) -> Callable[[dict], float | None]:
    """A column of row[num] / row[den] (None where either is missing)."""
    def get(r):
        a, b = r.get(num), r.get(den)
        return a / b if a and b else None
    return get


def pct(key: str) -> Callable[[dict], str | None]:
    """A column of row[key] (a fraction) as a percentage."""
    return lambda r: None if r.get(key) is None else f"{100 * r[key]:.1f}%"


def gib(key: str) -> Callable[[dict], float | None]:
    """A column of row[key] (bytes) in GiB."""
    return lambda r: None if r.get(key) is None else r[key] / 2**30


def label(r: dict):
    """A kernel config's name: its label, else its fields."""
    c = r.get("config")
    return c.get("label", c) if isinstance(c, dict) else c


@dataclasses.dataclass(frozen=True)
class Table:
    """A table of one results file: its rows (those `keep` accepts), one column per (header, key or function)."""

    file: str
    columns: tuple[tuple[str, str | Callable[[dict], object]], ...]
    keep: Callable[[dict], bool] = lambda r: True
    reduce: Callable[[list[dict]], list[dict]] | None = None  # e.g. the best of a sweep


def _best_of_sweeps(rows: list[dict]) -> list[dict]:
    """Of the fused norm/RoPE rows: per (cache, T) the xla row, the default launch (the Triton row with a device
    time: the benchmark traces the default alone) and the fastest launch of the sweep by wall time."""
    out, groups = [], {}
    for r in rows:
        groups.setdefault((r["cache"], r["T"]), []).append(r)
    for rs in groups.values():
        triton = [r for r in rs if r["impl"] != "xla"]
        default = next((r for r in triton if r.get("device_us") is not None), None)
        best = min(triton, key=lambda r: r["us"]) if triton else None
        out += [r for r in rs if r["impl"] == "xla"]
        out += [dict(default, pick="default")] if default else []
        out += [dict(best, pick="fastest (wall)")] if best is not None and best is not default else []
    return out


def _headline(rows: list[dict]) -> list[dict]:
    """The rows of the kernels the model runs by default: sparse MLA's Mosaic kernel, the indexer's Mosaic scores
    with the select top-k as the model calls it (a set), the fused norm/RoPE default launch."""
    out = []
    for r in rows:
        if r["op"] == "sparse_mla" and r["impl"].startswith("mosaic"):
            out.append(r)
        elif (r["op"] == "indexer" and r.get("stage") == "scores+topk" and r["impl"] == "mosaic"
              and r.get("config") == {"ordered": False}):
            out.append(r)
    fused = _best_of_sweeps([r for r in rows if r["op"] == "fused_norm_rope"])
    return out + [r for r in fused if r.get("pick") == "default"]


def _sources(r: dict) -> str:
    """A row's sources in a cell: each one's links (the record keeps the full lines), or its text where it has none
    (the shard run, the MTP acceptance)."""
    out = []
    for src in r.get("sources", []):
        links = re.findall(r"https://\S+[^\s.,;:)'\"]", src)
        out += [u for u in links if u not in out] if links else [src]
    return "; ".join(out)


TABLES = {
    "headline": Table("attention", (
        ("op", "op"), ("cache", "cache"), ("B or T", lambda r: r.get("B", r.get("T"))), ("impl", "impl"),
        ("device µs", "device_us"), ("xla device µs", "xla_device_us"),
        ("speed-up", ratio("xla_device_us", "device_us"))), reduce=_headline),
    "attention": Table("attention", (
        ("op", "op"), ("stage", "stage"), ("cache", "cache"), ("B", "B"), ("impl", "impl"), ("config", label),
        ("device µs", "device_us"), ("xla device µs", "xla_device_us"), ("speed-up (device)",
                                                                          ratio("xla_device_us", "device_us")),
        ("wall µs", "us"), ("xla wall µs", "xla_us"), ("TB/s", "tb_s")),
        keep=lambda r: r["op"] in ("sparse_mla", "indexer")),
    "attention_move": Table("attention_move", (
        ("op", "op"), ("rows paired", "pairs"), ("after / before (median)", "median_ratio"), ("min", "min_ratio"),
        ("max", "max_ratio"), ("largest change", "largest_change")),
        keep=lambda r: r.get("check") == "compare"),
    "fused_norm_rope": Table("attention", (
        ("cache", "cache"), ("T", "T"), ("impl", "impl"), ("launch", "pick"), ("config", label),
        ("device µs", "device_us"), ("xla device µs", "xla_device_us"),
        ("speed-up (device)", ratio("xla_device_us", "device_us")), ("wall µs", "us"), ("xla wall µs", "xla_us"),
        ("TB/s (wall)", "tb_s")),
        keep=lambda r: r["op"] == "fused_norm_rope", reduce=_best_of_sweeps),
    "moe": Table("moe", (
        ("op", "op"), ("weights", "weights"), ("form", "form"), ("rows", "rows"), ("tp", "tp"), ("dims", "dims"),
        ("experts used", "experts_used"), ("impl", "impl"), ("config", label), ("device µs", "device_us"), ("TFLOP/s", "tflops"),
        ("HBM", pct("hbm_fraction")))),
    "fp8_gemm_mosaic": Table("fp8_gemm_mosaic", (
        ("op", "op"), ("weights", "weights"), ("impl", "impl"), ("form", "form"), ("rows", "rows"), ("tp", "tp"),
        ("dims", "dims"), ("experts used", "experts_used"),
        ("gate+up tile", lambda r: "{tile_m} x {tile_n}, {stages} stages".format(**r["config"][0]) if r.get("config")
         else None),
        ("device µs", "device_us"), ("TFLOP/s", "tflops"),
        ("HBM", pct("hbm_fraction")), ("rel. diff. from mosaic", "rel_diff_mosaic")),
        keep=lambda r: r["op"] in ("moe_prefill", "moe_decode")),
    "fp8_gemm_configs": Table("fp8_gemm_configs", (
        ("case", "case"), ("tile", lambda r: f"{r['config']['tile_m']} x {r['config']['tile_n']}"),
        ("stages", lambda r: r["config"]["stages"]), ("compute WGs", lambda r: r["config"]["compute_wgs"]),
        ("m_sub", lambda r: r["config"]["m_sub"]), ("swap AB", lambda r: r["config"]["swap_ab"]),
        ("chained tiles", lambda r: r["config"].get("chain", False)), ("status", "status"), ("wall ms", "wall_ms"),
        ("device ms", "dev_ms"), ("GEMM ms", "gemm_ms"),
        ("TFLOP/s (GEMM)", "tflops_gemm"), ("rel. error", lambda r: r.get("check", {}).get("rel_fro")),
        ("smem over limit, Mosaic (repo) bytes",
         lambda r: f"{r['over_mosaic']} ({r['over_repo']})" if r["status"] == "invalid" else None))),
    "e2e": Table("e2e", (
        ("preset", "preset"), ("layers", "layers"), ("weights", "weights"),
        ("FP8 experts, prefill", lambda r: r.get("fp8_experts_prefill")),
        ("FP8 linears, prefill", lambda r: r.get("fp8_linears_prefill")), ("kv cache", "kv_cache"),
        ("impl", "impl"), ("prefill batch x input", lambda r: f"{r['batch']} x {r['input_len']}" if r.get("prefill_s") else None),
        ("prefill s", "prefill_s"), ("prefill tok/s", "prefill_tokens_per_s"), ("prefill MFU", pct("prefill_mfu")),
        ("prefill MFU, FP8 peak", pct("prefill_mfu_fp8_peak")),
        ("decode context", "decode_context"),
        ("decode ms/step B=1", lambda r: r["decode_ms"].get("1")),
        ("B=32", lambda r: r["decode_ms"].get("32")), ("B=128", lambda r: r["decode_ms"].get("128"))),
        keep=lambda r: "check" not in r),
    "batch_invariant_cost": Table("batch_invariance", (
        ("preset", "preset"), ("layers", "layers"), ("weights", "weights"), ("kv cache", "kv_cache"),
        ("impl", "impl"), ("phase", "phase"),
        ("shape", lambda r: f"{r['batch']} x {r['input_len']}" if r["phase"] == "prefill"
         else f"B={r['B']} at {r['context']}"),
        ("default", lambda r: f"{fmt(r.get('default_s'))} s" if r["phase"] == "prefill"
         else f"{fmt(r.get('default_ms'))} ms"),
        ("batch-invariant", lambda r: f"{fmt(r.get('invariant_s'))} s" if r["phase"] == "prefill"
         else f"{fmt(r.get('invariant_ms'))} ms"),
        ("ratio", "ratio"), ("limit", "limit"), ("within", "within_limit")),
        keep=lambda r: r.get("check") == "batch_invariant_cost"),
    "serving_host": Table("serving", (
        ("B", "B"), ("decode step ms", "step_ms"), ("device step ms (replayed)", "device_step_ms"),
        ("idle ms", "idle_ms"), ("idle", pct("idle_fraction")), ("host busy ms (overlapped)", "host_ms"),
        ("build / launch / process ms", lambda r: " / ".join(fmt(r.get(f"{k}_ms_per_step"))
                                                             for k in ("build", "launch", "process")))),
        keep=lambda r: r.get("check") == "host_overhead"),
    "serving_modes": Table("serving", (
        ("mode", "mode"), ("requests", "requests"), ("output tok/s", "output_tokens_per_s"),
        ("TTFT p50 / p99 ms", lambda r: f"{fmt(r.get('ttft_ms_p50'))} / {fmt(r.get('ttft_ms_p99'))}"),
        ("TPOT p50 / p99 ms", lambda r: f"{fmt(r.get('tpot_ms_p50'))} / {fmt(r.get('tpot_ms_p99'))}"),
        ("steps", "steps"), ("mean running", "mean_running")),
        keep=lambda r: r.get("check") == "serving"),
    "serving_prefix": Table("serving", (
        ("prefix caching", lambda r: "on" if r["setting"] == "prefix_caching" else "off"), ("turns", "turns"),
        ("output tok/s", "output_tokens_per_s"),
        ("TTFT p50 / p99 ms", lambda r: f"{fmt(r.get('ttft_ms_p50'))} / {fmt(r.get('ttft_ms_p99'))}"),
        ("prompt tokens cached / queried", lambda r: f"{r['prefix_cache_hits']} / {r['prefix_cache_queries']}"),
        ("TTFT p50 speed-up", "ttft_p50_speedup"), ("output tok/s ratio", "output_tokens_per_s_ratio"),
        ("preemptions", "preemptions"), ("steps", lambda r: fmt(r.get("steps"))),
        ("step ms (host)", lambda r: f"{fmt(r.get('step_ms'))} ({fmt(r.get('host_ms_per_step'))})"),
        ("decode step ms", lambda r: fmt(r.get("decode_step_ms"))),
        ("compiled in the timed pass", lambda r: fmt(r.get("compiles")))),
        keep=lambda r: r.get("check") == "multi_turn"),
    "dcp_timing": Table("dcp", (
        ("variant", "variant"), ("total s", "total_s"), ("prefill s", "prefill_s"),
        ("decode ms/step", "decode_ms_per_step"), ("params GiB / device", gib("param_bytes_per_device")),
        ("cache GiB / device", gib("cache_bytes_per_device")), ("peak GiB / device", gib("peak_bytes"))),
        keep=lambda r: r.get("check") == "timing"),
    "dcp_identity": Table("dcp", (
        ("dtype", "dtype"), ("variant", "variant"), ("greedy tokens equal", "tokens_equal"), ("of", "tokens"),
        ("forced logits rel L2", "forced_logits_rel_l2"), ("top-1 agreement", "forced_top1_agreement"),
        ("median row", "forced_row_rel_median"), ("rows with other experts (layer: positions)",
                                                  "forced_rows_rerouted")),
        keep=lambda r: r.get("check") == "identity"),
    "mtp": Table("mtp", (
        ("k", "k"), ("B", "B"), ("plain ms", "plain_ms"), ("verify ms", "verify_ms"), ("draft ms", "draft_ms"),
        ("draft + verify ms", "spec_ms"), ("ratio", "ratio"), ("synchronous turn ms", "turn_ms"),
        ("turn ratio", "turn_ratio"), ("B=1 plain tok/s", "plain_tok_s"), ("oracle drafts tok/s", "oracle_tok_s"),
        ("oracle mean accepted length", "oracle_mean_accepted_length"))),
    "projection": Table("projection", (
        ("system", "system"), ("DCP", "dcp"), ("concurrency", "concurrency"), ("MTP", "mtp"),
        ("step ms", "step_ms"), ("compute ms", "compute_ms"), ("stage sum ms", "stage_sum_ms"),
        ("x whole step / stage sum", "compute_scale"), ("scale from", "scaled_by"), ("collective ms", "collective_ms"),
        ("output tok/s per GPU", "tok_s_per_gpu"), ("TTFT ms (one 8K prompt)", "ttft_ms"),
        ("largest cost", "largest_cost"), ("sources", _sources))),
    "multihost": Table("multihost", (
        ("run", "run"), ("decode ms/step", "decode_ms_per_step"), ("decode steps", "decode_steps"),
        ("prefill s", "prefill_s"), ("decode step alone ms", "decode_step_ms"))),
}


def load(name: str, results: str = RESULTS) -> dict | None:
    """results/NAME.json, or None where the suite has not written it yet."""
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _date(s: str) -> str:
    return s[:10] if s else "—"


def _provenance(src: dict) -> str:
    command = " ".join(src["command"].split())  # one line in the table's heading
    note = f" ({src['note']})" if src.get("note") else ""
    return (f"{src['device']}, jax {src.get('jax') or '—'}, {_date(src['date'])}, commit `{src['commit']}`: "
            f"`{command}`{note}")


def render_table(name: str, results: str = RESULTS) -> str:
    """The markdown of table `name` (a key of `TABLES`): provenance line(s), then the table."""
    t = TABLES[name]
    rec = load(t.file, results)
    if rec is None or not rec.get("rows"):
        return (f"No figures yet: `python -m benchmarks suite --only {t.file}` writes "
                f"benchmarks/results/{t.file}.json.\n")
    rows = [r for r in rec["rows"] if t.keep(r)]
    if t.reduce:
        rows = t.reduce(rows)
    if not rows:
        return f"No rows of this table in benchmarks/results/{t.file}.json (`{rec['command']}`).\n"
    sources = rec.get("sources")
    lines = []
    if sources:  # those this table's rows came from
        used = sorted({i for r in rows for i in (r["source"] if isinstance(r["source"], list) else [r["source"]])})
        lines += [f"- run {i}: {_provenance(sources[i])}" for i in used]
    else:
        lines.append(f"- {_provenance(rec)}")
    rebuilt = rec.get("rebuilt")
    if rebuilt:  # rows read back from the run's printed log (its record did not come back)
        lines.append(f"- rows rebuilt from that run's printed log, {_date(rebuilt['date'])}, commit "
                     f"`{rebuilt['commit']}`: `{' '.join(rebuilt['command'].split())}`")
    again = rec.get("reprojected")
    if again:  # rows recomputed from the record's own measurements, later and elsewhere
        lines.append(f"- rows reprojected from that run's measurements, {_date(again['date'])}, commit "
                     f"`{again['commit']}`: `{' '.join(again['command'].split())}`")
    cols = list(t.columns)
    if sources:
        cols.insert(0, ("run", "source"))
    cols = [(h, c) for h, c in cols if callable(c) or any(c in r for r in rows)]  # no column of nothing
    lines += ["", "| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(c(r) if callable(c) else r.get(c)) for _, c in cols) + " |")
    return "\n".join(lines) + "\n"


def render_text(text: str, results: str = RESULTS) -> str:
    """`text` with every marked table region rewritten; KeyError naming an unknown table."""
    def sub(m):
        if m["name"] not in TABLES:
            raise KeyError(f"render: unknown table {m['name']!r} (tables: {', '.join(TABLES)})")
        return m.group(1) + render_table(m["name"], results) + m.group(4)
    return _REGION.sub(sub, text)


def main(check: bool = False, docs: tuple[str, ...] = DOCS, results: str = RESULTS) -> int:
    """Rewrite the tables of `docs` (or, with `check`, only say which are out of date: exit code 1)."""
    stale = []
    for path in docs:
        with open(path) as f:
            old = f.read()
        new = render_text(old, results)
        if new != old:
            stale.append(path)
            if not check:
                with open(path, "w") as f:
                    f.write(new)
    for path in stale:
        print(f"render: {os.path.relpath(path, REPO)} " + ("is out of date with benchmarks/results/*.json "
                                                           "(python -m benchmarks render)" if check else "rewritten"))
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(check="--check" in sys.argv[1:]))
