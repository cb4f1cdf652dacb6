"""A small CPU run of the end-to-end benchmark (speed is measured on the GPU, never asserted here)."""

import json

from glm_dsa.bench import decode_attention_bytes, flops_per_token
from glm_dsa.cli import main
from glm_dsa import configs


def test_bench_help_and_small_cpu_run(tmp_path, capsys):
    try:
        main(["bench", "--help"])
    except SystemExit as e:
        assert e.code == 0
    assert "--decode-batches" in capsys.readouterr().out
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--input-len", "24", "--output-len", "3", "--batch", "2",
                 "--decode-batches", "2", "--max-num-batched-tokens", "16", "--json-out", str(out)]) == 0
    res = json.loads(out.read_text())
    r = res["impls"]["xla"]
    assert r["prefill_tokens_per_s"] > 0 and r["end_to_end_s"] > 0
    d = r["decode"]["2"]
    assert d["ms_per_step"] > 0 and set(d["stages_ms"]) == {"indexer", "sparse_mla", "norms_rope_cache", "moe",
                                                            "collectives"}
    assert "decode B=2" in capsys.readouterr().out


def test_roofline_counts_by_hand():
    cfg = configs.glm52
    # B=128 at 32K: 78 layers x 2048 rows x 576 x 2 B + 21 full layers x 32768 keys x 128 x 2 B, per sequence
    want = 128 * (78 * 2048 * 576 * 2 + 21 * 32768 * 128 * 2)
    assert decode_attention_bytes(cfg, 128, 32768, 2) == want
    assert 2 * 30e9 < flops_per_token(cfg, 1) < 2 * 50e9  # ~40B active parameters per token
