"""`info` with FP8 weights (bytes per device against a hand count, QREP included, and the KV room left), the GLM-5.2
acceptance line (<= 100 GiB per device at TP=8, with QREP at DCP=8 too), and `convert` keeping an FP8 release FP8."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import glm_dsa
from checkpoints import orbax_io
from checkpoints.fp8_blocks import write_fp8_release
from checkpoints.layout import param_specs
from checkpoints.random import write_random_checkpoint
from glm_dsa.cli import main, param_bytes_per_device
from glm_dsa.model.paged_cache import cache_bytes_per_token
from glm_dsa.model.loading import load_params
from glm_dsa.model.step import resolve_parallel
from sharding import ParallelConfig

ROOT = Path(__file__).resolve().parents[2]
CFG = glm_dsa.configs.tiny
GIB = 2 ** 30
LINEAR = ("q_a_proj", "q_b_proj", "kv_a_proj", "o_proj", "wq_b", "wk", "mlp.gate", "mlp.up", "mlp.down",
          "experts_gate", "experts_up", "experts_down", "shared_gate", "shared_up", "shared_down")  # not kv_b_proj


def _blocks(n):
    return -(-n // 128)


def _hand_bytes_one_device(cfg) -> int:
    """Every parameter on one device with the FP8 plan, counted from the config's widths by hand: linear weights
    (but kv_b_proj) 1 byte plus a float32 scale per 128 x 128 block of [in, out]; norms, router, indexer
    weights_proj 4 bytes; embeddings, lm_head, kv_b_proj 2 bytes (bf16)."""
    D, H, Rq, Rkv = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    Dn, Dr, Dv, E, Im = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.n_routed_experts, \
        cfg.moe_intermediate_size
    Hi, Di, Is, I = cfg.index_n_heads, cfg.index_head_dim, cfg.moe_intermediate_size * cfg.n_shared_experts, \
        cfg.intermediate_size

    def fp8(n_in, n_out, lead=1):
        return lead * (n_in * n_out + 4 * _blocks(n_in) * _blocks(n_out))

    total = 2 * cfg.vocab_size * D + 2 * D * cfg.padded_vocab_size + 4 * D  # embed, lm_head, final norm
    for i in range(cfg.num_hidden_layers):
        total += 4 * (2 * D + Rq + Rkv)  # norms
        total += fp8(D, Rq) + fp8(Rq, H * (Dn + Dr)) + fp8(D, Rkv + Dr) + fp8(H * Dv, D)
        total += 2 * Rkv * H * (Dn + Dv)  # kv_b_proj, dequantised at load
        if cfg.indexer_types[i] == "full":
            total += fp8(Rq, Hi * Di) + fp8(D, Di) + 4 * (2 * Di + D * Hi)
        if cfg.mlp_layer_types[i] == "dense":
            total += 2 * fp8(D, I) + fp8(I, D)
        else:
            total += 4 * (D * E + E) + 2 * fp8(D, Im, E) + fp8(Im, D, E) + 2 * fp8(D, Is) + fp8(Is, D)
    return total


def _plan(cfg):
    return frozenset(p for p in param_specs(cfg) if any(p.endswith(n) for n in LINEAR))


def test_bytes_per_device_match_a_hand_count():
    plan = _plan(CFG)
    one = resolve_parallel(ParallelConfig(1), CFG)
    total, per_device = param_bytes_per_device(CFG, one, False, "bfloat16", plan)
    assert total == per_device == _hand_bytes_one_device(CFG)
    # QREP (TP=4, DCP=2): q_b_proj (FP8) and kv_b_proj (bf16) are split over the 2 TP groups instead of all 4
    # devices; tiny's scale grids (one block) are replicated either way
    par = resolve_parallel(ParallelConfig(4, 2, dcp_q_replicate=True), CFG)
    _, without = param_bytes_per_device(CFG, par, False, "bfloat16", plan)
    _, with_qrep = param_bytes_per_device(CFG, par, True, "bfloat16", plan)
    qb = CFG.q_lora_rank * CFG.num_attention_heads * CFG.qk_head_dim
    kvb = 2 * CFG.kv_lora_rank * CFG.num_attention_heads * (CFG.qk_nope_head_dim + CFG.v_head_dim)
    assert with_qrep - without == CFG.num_hidden_layers * (qb + kvb) * (1 / 2 - 1 / 4)
    # FP8 saves 1 byte of every linear weight element but adds its block scales
    _, bf16 = param_bytes_per_device(CFG, one, False, "bfloat16")
    saved = sum(math.prod(s.shape) for p, s in param_specs(CFG).items() if p in plan)
    scales = _hand_bytes_one_device(CFG) - (bf16 - saved)
    assert 0 < scales < saved / 10


def test_info_prints_fp8_bytes_and_kv_room(capsys):
    argv = ["info", "--preset", "tiny", "-tp", "4", "-dcp", "2", "--dcp-q-replicate", "--quantization", "fp8",
            "--device-memory", "0.01", "--json"]
    assert main(argv) == 0
    info = json.loads(capsys.readouterr().out)
    par = resolve_parallel(ParallelConfig(4, 2, dcp_q_replicate=True), CFG)
    _, with_qrep = param_bytes_per_device(CFG, par, True, "bfloat16", _plan(CFG))
    assert info["quantization"] == "fp8" and info["fp8_weights"] == len(_plan(CFG))
    assert info["param_bytes_per_device"] == f"{with_qrep / 1024:.2f} KiB"
    per_seq = 32768 // 2 * cache_bytes_per_token(CFG, "bfloat16")  # a DCP rank holds half of each sequence
    assert info["kv_32k_sequences_fit"] == (int(0.01 * GIB) - with_qrep) // per_seq
    assert main(["info", "--preset", "tiny", "--json"]) == 0  # the default: no FP8
    assert json.loads(capsys.readouterr().out)["fp8_weights"] == 0


def _gib(out: str, key: str) -> float:
    line = next(ln for ln in out.splitlines() if ln.strip().startswith(key + ":"))
    value, unit = line.split(":", 1)[1].split()
    assert unit == "GiB", line
    return float(value)


@pytest.mark.parametrize("flags", [[], ["-dcp", "8", "--dcp-q-replicate"]])
def test_glm52_fp8_fits_an_h200_at_tp8(flags):
    """The acceptance line: `info --preset glm52 -tp 8 --quantization fp8` <= 100 GiB per device, QREP too."""
    out = subprocess.run([sys.executable, "-m", "glm_dsa", "info", "--preset", "glm52", "-tp", "8",
                          "--quantization", "fp8", *flags], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    per_device = _gib(out.stdout, "param_bytes_per_device")
    assert 80 < per_device <= 100
    if flags:
        with_qrep, without = (_gib(out.stdout, f"param_bytes_per_device_{k}") for k in ("with_qrep", "without_qrep"))
        assert with_qrep == per_device and with_qrep > without
    fit = int(next(ln for ln in out.stdout.splitlines() if "kv_32k_sequences_fit" in ln).split(":")[1])
    assert fit > 10


def test_convert_keeps_an_fp8_release_fp8(tmp_path):
    cfg = CFG.replace(num_hidden_layers=2, indexer_types=("full", "shared"))
    write_random_checkpoint(cfg, tmp_path / "hf", seed=1, dtype="float32", progress=False)
    write_fp8_release(tmp_path / "hf", tmp_path / "fp8")

    def convert(*flags):
        out = subprocess.run([sys.executable, "-m", "glm_dsa", "convert", "--from", str(tmp_path / "fp8"),
                              "--no-progress", *flags], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "linear weights FP8" in convert("--to", str(tmp_path / "kept"))
    meta = orbax_io.read_orbax_metadata(tmp_path / "kept")["params"]
    fp8 = {p for p, m in meta.items() if m["dtype"] == "float8_e4m3fn"}
    assert fp8 == set(_plan(cfg)) and all(meta[p + "_scale"]["dtype"] == "float32" for p in fp8)
    _, _, flat = load_params(tmp_path / "kept", progress=False)  # restored as FP8
    assert {p for p, a in flat.items() if a.dtype == np.dtype(ml_dtypes.float8_e4m3fn)} == fp8
    convert("--to", str(tmp_path / "plain"), "--quantization", "none")
    meta = orbax_io.read_orbax_metadata(tmp_path / "plain")["params"]
    assert not any(m["dtype"] == "float8_e4m3fn" or p.endswith("_scale") for p, m in meta.items())
