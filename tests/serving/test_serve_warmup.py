"""`serve --warmup-steps`: the server compiles its step shapes before it answers, so no request waits for a compile;
`/metrics` reports `step_shapes_compiled`; the flags are checked before the model loads."""

import io
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import KEY, MODEL, serve_process  # noqa: E402

MAX_LEN = 48


def test_served_requests_compile_nothing_after_the_warm_up(ckpt, tmp_path_factory):
    """Requests of every length up to the bound, greedy and sampled, one at a time and several at once, run on
    the shapes compiled before /health answered: the count /metrics reports does not move. Without the flag
    (the negative control) the same requests compile."""
    import httpx

    rng = np.random.default_rng(0)
    prompts = [rng.integers(9, 200, n).tolist() for n in (1, 5, 17, 30, 40)]

    def traffic(s):
        for i, p in enumerate(prompts):
            body = {"model": MODEL, "prompt": p, "max_tokens": MAX_LEN - len(p), "temperature": 0.0 if i % 2 else 0.8,
                    "ignore_eos": True}
            assert s.post("/v1/completions", body).status_code == 200
        with httpx.Client(timeout=60) as c:  # several at once: steps of several requests and rows
            import concurrent.futures as cf
            with cf.ThreadPoolExecutor(4) as pool:
                codes = list(pool.map(lambda p: c.post(
                    s.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0.5}).status_code, prompts[:4]))
        assert codes == [200] * 4

    flags = ("--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--block-size", "16")
    with serve_process(ckpt, tmp_path_factory, "--warmup-steps", *flags, max_len=MAX_LEN) as s:
        compiled = s.metrics()["step_shapes_compiled"]
        assert compiled > 0
        assert "step shapes compiled in" in s.log and f"/ {compiled:.0f} step shapes" in s.log  # progress lines
        traffic(s)
        assert s.metrics()["step_shapes_compiled"] == compiled
    with serve_process(ckpt, tmp_path_factory, *flags, max_len=MAX_LEN) as s:
        assert s.metrics()["step_shapes_compiled"] == 0
        traffic(s)
        assert 0 < s.metrics()["step_shapes_compiled"] <= compiled


def test_warm_up_bounds_the_widths_by_max_len(ckpt):
    """A smaller max_len compiles only the block-table widths its requests reach: fewer shapes; a request past it
    compiles its own width later; max_len past max_model_len is refused."""
    import glm_dsa
    from glm_dsa.cli import warm_up

    kw = dict(dtype="float32", max_model_len=256, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
              progress=False)
    full, short = glm_dsa.load(str(ckpt), **kw), glm_dsa.load(str(ckpt), **kw)
    log = io.StringIO()
    n_full = warm_up(full, out=log)
    n_short = warm_up(short, 32, out=io.StringIO())
    # block-table widths are power-of-two buckets of pages from 8 up to a sequence's 64 pages: 8, 16, 32 and 64
    # for 256 tokens, 8 for 32 tokens (8 pages); each with the one rows and requests bucket, greedy and sampled
    assert (n_full, n_short) == (4 * 2, 1 * 2)
    assert log.getvalue().splitlines()[-1].startswith(f"warm-up: {n_full} step shapes compiled in")
    before = short.metrics()["step_shapes_compiled"]
    short.generate([[5] * 100], 4)  # 26 pages: width 32, not compiled
    assert short.metrics()["step_shapes_compiled"] > before
    with pytest.raises(ValueError, match="max_len must be in 1..256"):
        warm_up(short, 257)


@pytest.mark.parametrize("args, message", [
    (["--warmup-max-len", "64"], "--warmup-max-len is a bound of --warmup-steps"),
    (["--warmup-steps", "--num-speculative-tokens", "1"], "--warmup-steps does not compile the speculative"),
    (["--warmup-steps", "--warmup-max-len", "600", "--max-model-len", "512"], "--warmup-max-len 600 is over"),
])
def test_bad_warmup_flags_fail_before_the_model_loads(args, message, tmp_path, capsys):
    """The checks run before anything is read: a checkpoint path that does not exist is never reached."""
    from glm_dsa.cli import main
    assert main(["serve", "--checkpoint", str(tmp_path / "missing"), *args]) == 2
    assert message in capsys.readouterr().err
