"""The DCP benchmark on 4 of the 8 simulated devices: it reports identity with DCP = 1 and per-device bytes."""

import pytest

from benchmarks import bench_dcp as dcp_bench
from glm_dsa import configs


def test_dcp_bench_small_run(monkeypatch):
    monkeypatch.delenv("GLM_DSA_DCP_Q_REPLICATE", raising=False)
    bc = dcp_bench.DcpBenchConfig(preset="tiny", tp=4, dcp=4, variants=("qrep:a2a", "noqrep:ag_rs"),
                                  identity_prompt_len=20, identity_batch=2, identity_steps=6, input_len=24,
                                  output_len=3, batch=2, dtype="float32", max_num_batched_tokens=32)
    lines = []
    res = dcp_bench.run_dcp_bench(bc, log=lines.append)
    for v in bc.variants:
        ident = res["identity"][v]
        assert ident["identical"] and ident["tokens_equal"] == ident["tokens"] == 12
        assert ident["first_difference"] == [None, None]
        assert ident["forced_logits_rel_l2"] < 1e-5 and ident["forced_top1_agreement"] == 1.0
        assert ident["forced_row_rel_median"] < 1e-5 and ident["forced_rows_over_1e-3"] == []
        cfg = configs.get(bc.preset)
        moe_layers = [str(i) for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
        assert ident["forced_rows_rerouted"] == {layer: [] for layer in moe_layers}
    t = res["timing"]
    assert set(t) == {"dcp1", "qrep:a2a", "noqrep:ag_rs"}
    # QREP keeps the query projections whole on every DCP rank: more parameter bytes per device than without
    assert t["qrep:a2a"]["param_bytes_per_device"] > t["noqrep:ag_rs"]["param_bytes_per_device"]
    # KV split over 4 ranks: each holds about a quarter of DCP = 1's cache (pages are per rank)
    assert t["noqrep:ag_rs"]["cache_bytes_per_device"] < t["dcp1"]["cache_bytes_per_device"]
    assert all(r["total_s"] > 0 and r["decode_ms_per_step"] > 0 for r in t.values())
    assert len(lines) == 2 + 3
    rec = dcp_bench.to_record(res, command="python benchmarks/bench_dcp.py --preset tiny")
    assert rec["command"] == "python benchmarks/bench_dcp.py --preset tiny" and rec["device"] == res["device"]
    assert [(r["check"], r["variant"]) for r in rec["rows"]] == [("identity", v) for v in bc.variants] + [
        ("timing", v) for v in ("dcp1", *bc.variants)]
    assert rec["rows"][-1]["total_s"] == t["noqrep:ag_rs"]["total_s"] and rec["identity"] == res["identity"]


def test_variant_names_and_env_guard(monkeypatch):
    assert dcp_bench.parse_variant("noqrep:a2a") == (False, "a2a")
    with pytest.raises(ValueError, match="want qrep"):
        dcp_bench.parse_variant("qrep:nccl")
    monkeypatch.setenv("GLM_DSA_DCP_Q_REPLICATE", "1")
    with pytest.raises(ValueError, match="unset GLM_DSA_DCP_Q_REPLICATE"):
        dcp_bench.run_dcp_bench(dcp_bench.DcpBenchConfig(preset="tiny"))
