"""`python -m glm_dsa {generate,serve,info,demo,random-checkpoint,convert}`: the command line, with vLLM-style flags."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from .model.presets import PRESETS

PRESET_NAMES = sorted(PRESETS)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be integers separated by commas or spaces: {text!r}")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = None
    if port is None or not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in 1..65535, got {text!r}")
    return port


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty or blank, got {text!r}")
    return text


def _positive(kind):
    """An argparse type: a finite number of `kind` (int or float) > 0."""
    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            x = None
        if x is None or not 0 < x < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a {'positive integer' if kind is int else 'number > 0'}, "
                                             f"got {text!r}")
        return x
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _non_negative_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = -1.0
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return x


def _add_parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    g.add_argument("--dcp-q-replicate", dest="dcp_q_replicate", action="store_true", default=None)
    g.add_argument("--no-dcp-q-replicate", dest="dcp_q_replicate", action="store_false")
    g.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a"], default=None)
    g.add_argument("--cp-kv-cache-interleave-size", type=int, default=1)


def _add_distributed_flags(p: argparse.ArgumentParser) -> None:
    from .distributed import add_flags
    add_flags(p)


def _start_distributed(args) -> None:
    """Join the multi-process runtime when the flags or JAX_* variables ask for it; only process 0 prints."""
    if not hasattr(args, "coordinator_address"):
        return
    from . import distributed
    if distributed.initialize_from_flags(args) and not distributed.is_primary():
        # every process computes the same results; process 0 reports them. At the descriptor level: the
        # collectives' C++ libraries (gloo) print to fd 1 themselves
        sys.stdout.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.stdout = open(os.devnull, "w")


def _parallel(args):
    from sharding import ParallelConfig
    return ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                          decode_context_parallel_size=args.decode_context_parallel_size,
                          dcp_q_replicate=args.dcp_q_replicate, dcp_comm_backend=args.dcp_comm_backend,
                          cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size)


def _add_quantization_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default=None, choices=["fp8", "none"],
                   help="fp8: keep linear weights FP8 on the devices (128x128 block scales; a bf16/fp32 checkpoint "
                        "is quantised at load); none: dequantise FP8 weights to --dtype (default: the checkpoint's "
                        "own form, an FP8 release stays FP8)")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    from kernels import IMPLS
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32", "fp8_ds_mla"])
    p.add_argument("--max-model-len", type=int, default=None)
    _add_quantization_flag(p)
    p.add_argument("--impl", default=None, choices=IMPLS,
                   help="op implementation (default: the platform's, kernels.default_impl(): 'auto' on an NVIDIA "
                        "GPU, each op's fastest Pallas kernel per shape, the xla references elsewhere)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="bitwise reproducible requests: a request's tokens and logprobs do not depend on the rest "
                        "of the batch, its row position or prefill chunking (glm_dsa.Engine batch_invariant)")
    p.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                   help="keep compiled steps in DIR (created if missing; JAX's persistent compilation cache): a "
                        "later run of the same model, layout and step shapes loads them instead of compiling "
                        "(a server's warm-up with FP8 weights: minutes on first start)")
    _add_parallel_flags(p)
    _add_distributed_flags(p)


def _use_compilation_cache(args) -> None:
    """Point JAX's persistent compilation cache at --compilation-cache-dir (every compile, however short, is kept);
    OSError naming the flag when the folder cannot be made."""
    path = getattr(args, "compilation_cache_dir", None)
    if not path:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OSError(f"--compilation-cache-dir {path!r}: cannot create the folder ({e.strerror or e})") from None
    if not os.access(path, os.W_OK):
        raise OSError(f"--compilation-cache-dir {path!r}: the folder is not writable")
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _add_prefix_caching_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the cached pages of prompts that begin alike (default: on; "
                        "--no-enable-prefix-caching computes every prompt token)")


def _generate_and_report(eng, prompts, args, out=None, tokenizer=None) -> list[list[int]]:
    out = out or sys.stdout
    kw = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
              stop_token_ids=[] if args.ignore_eos else None)
    eng.generate(prompts, max_new_tokens=min(2, args.max_new_tokens), **kw)  # compile prefill and decode shapes
    eng.reset_prefix_cache()  # the timed run computes its prompts, not the warm-up's cached pages
    t0 = time.perf_counter()
    new = eng.generate(prompts, max_new_tokens=args.max_new_tokens, **kw)
    dt = time.perf_counter() - t0
    n = sum(len(x) for x in new)
    for i, (p, toks) in enumerate(zip(prompts, new)):
        print(f"prompt {i} ({len(p)} tokens): {p}", file=out)
        if tokenizer is not None:
            print(f"  prompt text: {tokenizer.decode(p)!r}", file=out)
        print(f"  generated {len(toks)}: {toks}", file=out)
        if tokenizer is not None:
            print(f"  text: {tokenizer.decode(toks)!r}", file=out)
    print(f"{n} tokens in {dt:.3f} s: {n / dt:.1f} tokens/s (prefill included, after warm-up)", file=out)
    t = eng.last_timings
    if "spec_mean_accepted_length" in t:
        per_pos = ", ".join(f"{x:.2f}" for x in t["spec_acceptance_per_position"])
        print(f"MTP: {t['spec_num_speculative_tokens']} drafts per step, mean accepted length "
              f"{t['spec_mean_accepted_length']:.2f}, acceptance per position [{per_pos}]", file=out)
    return new


def cmd_generate(args) -> int:
    import glm_dsa
    from .serving import text
    if not args.prompt_ids and not args.prompt:
        raise SystemExit("generate: give at least one --prompt TEXT or --prompt-ids IDS")
    tokenizer = text.load_tokenizer(args.checkpoint, required=bool(args.prompt))
    eng = glm_dsa.load(args.checkpoint, parallel=_parallel(args), dtype=args.dtype,
                       kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len, impl=args.impl,
                       num_speculative_tokens=args.num_speculative_tokens, quantization=args.quantization,
                       enable_prefix_caching=args.enable_prefix_caching, batch_invariant=args.batch_invariant)
    if tokenizer is not None:
        tokenizer.vocab_size = eng.config.vocab_size
    prompts = [tokenizer.encode(t) for t in args.prompt] + list(args.prompt_ids)
    _generate_and_report(eng, prompts, args, tokenizer=tokenizer)
    return 0


def cmd_serve(args) -> int:
    """Load a checkpoint and serve it over an OpenAI-compatible HTTP API (see glm_dsa.serving.server). Across processes,
    process 0 answers HTTP and the others run its steps in lockstep (see glm_dsa.serving.lockstep)."""
    import jax

    import glm_dsa
    from .serving import text
    from .serving.server import chat_template, listen_socket, serve
    _check_warmup_flags(args)
    # the port first: one in use fails now, not after the model has loaded (only process 0 answers HTTP)
    sock = listen_socket(args.host, args.port) if jax.process_index() == 0 else None
    tokenizer = text.load_tokenizer(args.checkpoint)
    engine_kw = {k: getattr(args, k) for k in ("max_num_seqs", "max_num_batched_tokens", "num_pages", "block_size")
                 if getattr(args, k) is not None}
    eng = glm_dsa.load(args.checkpoint, parallel=_parallel(args), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                       max_model_len=args.max_model_len, impl=args.impl, progress=False,
                       num_speculative_tokens=args.num_speculative_tokens, quantization=args.quantization,
                       enable_prefix_caching=args.enable_prefix_caching, batch_invariant=args.batch_invariant,
                       **engine_kw)
    if tokenizer is not None:
        tokenizer.vocab_size = eng.config.vocab_size
    name = args.served_model_name or os.path.basename(os.path.normpath(args.checkpoint))
    if args.warmup_steps:  # every process alike: the same padding steps, so multi-process collectives pair up
        warm_up(eng, args.warmup_max_len)

    def run(loop=None):
        serve(eng, model_name=name, host=args.host, port=args.port, api_key=args.api_key, tokenizer=tokenizer,
              template=chat_template(args.checkpoint), loop=loop, max_request_bytes=args.max_request_bytes,
              shutdown_timeout=args.shutdown_timeout, sock=sock)
    if jax.process_count() > 1:  # process 0 serves, the others follow its steps
        from .serving.lockstep import serve_in_lockstep
        return serve_in_lockstep(eng, run, timeout_s=args.distributed_timeout)
    run()
    return 0


def _check_warmup_flags(args) -> None:
    """serve's warm-up flags, checked before the model loads (ValueError naming the flag)."""
    if args.warmup_max_len is not None and not args.warmup_steps:
        raise ValueError("--warmup-max-len is a bound of --warmup-steps, which is not given")
    if args.warmup_steps and args.num_speculative_tokens > 0:
        raise ValueError("--warmup-steps does not compile the speculative decoding steps: leave it out with "
                         "--num-speculative-tokens (their turns compile on first use)")
    if args.warmup_max_len is not None and args.max_model_len is not None and args.warmup_max_len > args.max_model_len:
        raise ValueError(f"--warmup-max-len {args.warmup_max_len} is over --max-model-len {args.max_model_len}")


def warm_up(eng, max_len: int | None = None, out=None) -> int:
    """Compile `eng`'s serving-step shapes before it serves (`Engine.warmup_steps`): steps of up to its
    max_num_batched_tokens rows, at the block-table widths of requests of up to `max_len` tokens (default: the
    engine's max_model_len), greedy and sampled (steps that report logprobs compile when first asked for). Reports
    progress on `out` (default stderr) about every tenth of the shapes; returns how many were compiled."""
    out = sys.stderr if out is None else out
    max_len = eng.max_model_len if max_len is None else int(max_len)
    if not 0 < max_len <= eng.max_model_len:
        raise ValueError(f"warm-up: max_len must be in 1..{eng.max_model_len} (max_model_len), got {max_len}")
    t0 = time.perf_counter()
    print(f"warm-up: compiling the serving steps of up to {eng.max_num_batched_tokens} rows for requests of up to "
          f"{max_len} tokens", file=out, flush=True)

    def progress(done, total):  # done counts up by one: a line where it crosses a tenth of total, and at the end
        if done == total or done * 10 // total > (done - 1) * 10 // total:
            print(f"warm-up: {done} / {total} step shapes ({time.perf_counter() - t0:.0f} s)", file=out, flush=True)

    n = eng.warmup_steps(pages=range(1, eng.scheduler.pages_for(max_len) + 1), greedy=(True, False),
                         progress=progress)
    print(f"warm-up: {n} step shapes compiled in {time.perf_counter() - t0:.1f} s", file=out, flush=True)
    return n


def _check_write_target(path: str, flag: str, ours, what: str, overwrite: bool) -> str | None:
    """The rule of the commands that write a checkpoint directory: never destroy what they did not write.

    `path` missing or an empty directory: written, None. `path` holding a checkpoint of ours (`ours(path)`, the
    kind this command writes): replaced as the writer replaces it (atomically: interrupted, the old checkpoint
    stays readable); returns the line saying so. Any other non-empty directory: an error naming it and what it
    holds, unless `overwrite`, then written into (files of the names it writes are replaced, others kept). A
    file at `path`: an error."""
    if not os.path.exists(path):
        return None
    if not os.path.isdir(path):
        raise ValueError(f"{path} is a file, not a checkpoint directory (give {flag} a directory)")
    names = sorted(os.listdir(path))
    if not names:
        return None
    if ours(path):
        return f"replacing the {what} in {path} (atomically: until the new one is complete, the old one stays)"
    if not overwrite:
        shown = ", ".join(names[:5]) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")
        raise ValueError(f"{flag} {path} is a non-empty directory that is not a {what} written by glm-dsa (it "
                         f"holds {shown}); writing there would replace its files of the same names. Give a new or "
                         "empty directory, or pass --overwrite")
    return f"writing into the non-empty directory {path} (--overwrite: its files of the names written are replaced)"


def _remove_if_empty(path: str, existed: bool) -> None:
    """After a failed write: the directory the command created is removed again if nothing is in it."""
    if not existed:
        try:
            os.rmdir(path)
        except OSError:
            pass


def cmd_convert(args) -> int:
    """HF safetensors (bf16 / fp32 / FP8 block-scaled) or orbax -> a new committed orbax version at --to. Across
    processes each reads and writes only its own devices' shards (--to on a filesystem they share)."""
    import checkpoints
    from .model.loading import has_mtp_layer, load_params
    from .serving.text import TEXT_FILES

    src, dst = args.src, args.dst
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"convert: --from and --to are the same directory ({src})")
    checkpoints.check_save_target(dst)  # before loading anything
    note = _check_write_target(dst, "--to", checkpoints.is_orbax_checkpoint, "glm-dsa orbax checkpoint",
                               args.overwrite)
    if note:
        print(note, flush=True)
    existed = os.path.exists(dst)
    mtp = has_mtp_layer(src)  # a nextn layer travels with the model (in the compute dtype)
    cfg, _, flat = load_params(src, parallel=_parallel(args), dtype=args.dtype, progress=not args.no_progress,
                               quantization=args.quantization, mtp=mtp)
    extra = [os.path.join(src, f) for f in TEXT_FILES if os.path.isfile(os.path.join(src, f))]
    try:
        version = checkpoints.save_orbax_params(flat, cfg, dst, extra_files=extra, source=os.path.abspath(src),
                                                progress=not args.no_progress)
    except BaseException:
        _remove_if_empty(dst, existed)
        raise
    fp8 = sum(1 for p in flat if checkpoints.scale_path(p) in flat)
    print(f"converted {src} -> {version}: {len(flat) - fp8} parameters in {args.dtype}"
          + (f" ({fp8} linear weights FP8 with their block scales)" if fp8 else "")
          + (", the MTP (nextn) layer included" if mtp else "")
          + (f", with {', '.join(os.path.basename(f) for f in extra)}" if extra else ""))
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def param_bytes_per_device(cfg, parallel, q_replicate: bool, dtype, plan=frozenset()) -> tuple[int, int]:
    """(all parameter bytes, the bytes one device holds) for `cfg` on the mesh of a resolved `parallel` with QREP
    on or off, the weights in `plan` kept FP8 (1 byte each plus float32 block scales): `glm_dsa.model.placement`."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    import checkpoints
    from .model.placement import param_bytes_per_device as on_device

    itemsize = {"fp8": 1, "scale": 4, "fp32": 4, "weight": jnp.dtype(dtype).itemsize}
    leaves = checkpoints.stored_leaves(checkpoints.param_specs(cfg), frozenset(plan))
    total = sum(int(np.prod(shape)) * itemsize[kind] for shape, kind in leaves.values())
    per_device = on_device(cfg, dataclasses.replace(parallel, dcp_q_replicate=q_replicate), dtype=jnp.dtype(dtype),
                           plan=frozenset(plan))
    return total, per_device


def _info_plan(args, cfg):
    """The `QuantizationPlan` `info` counts bytes from: a preset's under --quantization (a preset stores nothing
    block-scaled, so by default nothing is FP8); a checkpoint's as `glm_dsa.load` makes it."""
    import checkpoints
    from .model.loading import checkpoint_fp8_plan, checkpoint_source

    if not args.checkpoint:
        return checkpoints.fp8_plan(checkpoints.param_specs(cfg), args.quantization, lambda spec: False)
    return checkpoint_fp8_plan(*checkpoint_source(args.checkpoint), cfg, args.quantization)


#: the sequence length `info` counts KV cache room in
INFO_SEQUENCE = 32768


def _simulate_devices(n: int) -> None:
    """`info --kernels` traces the step and runs nothing: on the CPU, over n simulated devices, unless jax's
    backends have already started (then the devices there are)."""
    import jax
    from jax._src import xla_bridge
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)


def cmd_info(args) -> int:
    if args.kernels:
        _simulate_devices(args.tensor_parallel_size)
    import numpy as np

    from checkpoints.layout import param_specs
    from .model import presets as configs
    from .model.config import GlmDsaConfig
    from .model.paged_cache import cache_bytes_per_token, pages_needed
    from .model.step import resolve_parallel

    cfg = configs.get(args.preset) if args.preset else GlmDsaConfig.from_pretrained(args.checkpoint)
    parallel = resolve_parallel(_parallel(args), cfg)
    if args.kernels:  # the kernels registry's dispatch table for these shapes on a GPU (traced, nothing runs)
        from glm_dsa.model.kernel_table import dispatch_table, format_table
        table = dispatch_table(cfg, parallel=parallel, kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
                               quantization=args.quantization, batch_invariant=args.batch_invariant)
        print(json.dumps(table, indent=2) if args.json else format_table(table))
        return 0
    plan = _info_plan(args, cfg)
    total, without = param_bytes_per_device(cfg, parallel, False, args.dtype, plan)
    _, with_qrep = param_bytes_per_device(cfg, parallel, True, args.dtype, plan) if parallel.dcp > 1 else (0, without)
    hosts = args.num_hosts
    if hosts < 1 or parallel.tp % hosts:
        raise ValueError(f"--num-hosts {hosts} must divide the {parallel.tp} devices of -tp {parallel.tp}")
    from sharding.mesh import axes_across_hosts
    per_device = with_qrep if parallel.q_replicate else without
    # KV room: what a device holds of one 32K sequence (its DCP rank's pages) in what its weights leave free
    device_bytes = int(args.device_memory * 2**30)
    seq_bytes = (pages_needed(INFO_SEQUENCE, 16, parallel.dcp, parallel.interleave) * 16
                 * cache_bytes_per_token(cfg, args.dtype, args.kv_cache_dtype))
    info = {
        "source": args.checkpoint or f"preset {args.preset}",
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "full_indexer_layers": list(cfg.full_layers),
        "shared_indexer_layers": [i for i in range(cfg.num_hidden_layers) if not cfg.is_full(i)],
        "dense_layers": [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe(i)],
        "parameters": int(sum(np.prod(s.shape) for s in param_specs(cfg).values())),
        "param_bytes": _human(total),
        "mesh": parallel.mesh_shape,
        "tensor_parallel_size": parallel.tp,
        "decode_context_parallel_size": parallel.dcp,
        "cp_kv_cache_interleave_size": parallel.interleave,
        "dcp_q_replicate": parallel.q_replicate,  # in effect (requested and DCP > 1)
        "dcp_q_replicate_model_default": cfg.parallel_defaults["dcp_q_replicate"],
        "dcp_q_replicate_requested": parallel.dcp_q_replicate,
        "dcp_comm_backend": parallel.dcp_comm_backend,
        "param_bytes_per_device_without_qrep": _human(without),
        "param_bytes_per_device_with_qrep": _human(with_qrep),
        "param_bytes_per_device": _human(per_device),
        "quantization": (plan.setting if plan.setting != "checkpoint"
                         else "the checkpoint's own" if args.checkpoint else "none"),
        "fp8_weights": len(plan),
        "device_memory": _human(device_bytes),
        f"kv_bytes_per_{INFO_SEQUENCE // 1024}k_sequence_per_device": _human(seq_bytes),
        f"kv_{INFO_SEQUENCE // 1024}k_sequences_fit": max(0, (device_bytes - per_device) // seq_bytes),
        "hosts": hosts,
        "devices_per_host": parallel.tp // hosts,
        "param_bytes_per_host": _human(per_device * (parallel.tp // hosts)),
        "mesh_axes_across_hosts": axes_across_hosts(parallel, parallel.tp // hosts),
        "kv_cache_bytes_per_token_per_dcp_group": cache_bytes_per_token(cfg, args.dtype, args.kv_cache_dtype),
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else cfg.rope_scaling.to_hf(cfg.rope_theta),
        "softmax_scale": cfg.softmax_scale,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": cfg.padded_vocab_size,
        "index_topk": cfg.index_topk,
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:>38}: {v}")
    return 0


def cmd_random_checkpoint(args) -> int:
    from checkpoints.random import is_random_checkpoint, write_random_checkpoint
    from .model import presets as configs
    cfg = configs.get(args.preset)
    if args.num_layers is not None:
        cfg = cfg.with_depth(args.num_layers)
    note = _check_write_target(args.out, "--out", is_random_checkpoint, "random checkpoint", args.overwrite)
    if note:
        print(note, flush=True)
    existed = os.path.exists(args.out)
    try:
        write_random_checkpoint(cfg, args.out, seed=args.seed, dtype=args.dtype,
                                max_shard_bytes=int(args.max_shard_mb * 2**20) if args.max_shard_mb else None,
                                with_mtp=args.with_mtp)
    except BaseException:
        _remove_if_empty(args.out, existed)
        raise
    print(f"wrote a random {args.preset} checkpoint ({cfg.num_hidden_layers} layers) to {args.out}")
    return 0


def cmd_demo(args) -> int:
    import glm_dsa
    from checkpoints.random import write_random_checkpoint
    from .model import presets as configs
    cfg = configs.get(args.preset)
    path = args.out or tempfile.mkdtemp(prefix="glm_dsa_demo_")
    print(f"writing a random '{args.preset}' checkpoint (GLM-5.2 layout: dense + MoE layers, full/shared indexer "
          f"layers {list(cfg.indexer_types)}) to {path}")
    write_random_checkpoint(cfg, path, seed=args.seed, dtype="bfloat16")
    eng = glm_dsa.load(path, dtype="bfloat16", max_model_len=256)
    import numpy as np
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (5, 11, 23)]
    _generate_and_report(eng, prompts, args)
    return 0


def cmd_bench(args) -> int:
    from glm_dsa.serving import benchmark
    if args.shard_of:  # one device's share of a layout, on one device
        if args.num_speculative_tokens:
            raise ValueError("--shard-of times plain decode steps of one device's share; drop --num-speculative-tokens "
                             "(benchmarks/bench_projection.py projects MTP from the share's stages)")
        from glm_dsa.serving import shard_benchmark
        return shard_benchmark.run_from_args(args)
    if args.num_speculative_tokens:  # MTP: draft + verify against plain decode
        return benchmark.run_mtp_from_args(args)
    return benchmark.run_from_args(args)


def _add_spec_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="MTP speculative decoding: K drafts per step from the checkpoint's nextn layer (0: off)")


def cmd_trace(args) -> int:
    import glm_dsa
    from .debug.trace import save_trace
    eng = glm_dsa.load(args.checkpoint, parallel=_parallel(args), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                       max_model_len=args.max_model_len, impl=args.impl, quantization=args.quantization)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    taps = eng.trace(args.prompt_ids, layers=layers)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_trace(taps, args.out, metadata={"checkpoint": args.checkpoint, "parallel": eng.parallel})
    print(f"wrote {len(taps)} tensors to {args.out}")
    return 0


def cmd_diff(args) -> int:
    from .debug.trace import diff_traces, format_diff, load_trace
    a, b = load_trace(args.a), load_trace(args.b)
    rows, first = diff_traces(a, b, rtol=args.rtol, atol=args.atol)
    print(format_diff(rows, first, set(a) - set(b), set(b) - set(a)))
    return 1 if first else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m glm_dsa", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="load a checkpoint and continue prompts given as text or token ids")
    g.add_argument("--checkpoint", required=True, help="HF safetensors or orbax (convert) directory")
    g.add_argument("--prompt", action="append", default=[],
                   help="one text prompt (repeat for a batch); needs tokenizer.json in the checkpoint directory")
    g.add_argument("--prompt-ids", type=_ids, action="append", default=[],
                   help="one prompt as comma- or space-separated token ids (repeat for a batch)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS ids")
    _add_spec_flag(g)
    _add_prefix_caching_flag(g)
    _add_model_flags(g)
    g.set_defaults(fn=cmd_generate)

    i = sub.add_parser("info", help="config, layer schedule and memory per device, without loading weights")
    src = i.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint")
    src.add_argument("--preset", choices=PRESET_NAMES)
    i.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    i.add_argument("--json", action="store_true")
    i.add_argument("--kernels", action="store_true",
                   help="print which kernel impl='auto' runs on a GPU for each op of this model's step (decode "
                        "B=1/32/128, a prefill chunk of 2048): the kernels registry's rules, traced on this machine")
    i.add_argument("--batch-invariant", action="store_true",
                   help="with --kernels: the table of batch-invariant mode's step shapes (a prompt step of 8192 "
                        "rows, decode steps in buckets of 8 to 256 rows) instead")
    _add_quantization_flag(i)
    i.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32", "fp8_ds_mla"])
    i.add_argument("--device-memory", type=_positive(float), default=141.0, metavar="GiB",
                   help="memory of one device, for the KV cache room left after the weights (default 141: H200)")
    i.add_argument("--num-hosts", type=int, default=1,
                   help="hosts the -tp devices are spread over (one process each): devices and bytes per host, and "
                        "the mesh axes whose collectives cross hosts")
    _add_parallel_flags(i)
    i.set_defaults(fn=cmd_info)

    r = sub.add_parser("random-checkpoint", help="write a random checkpoint in the HF layout")
    r.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    r.add_argument("--out", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    r.add_argument("--num-layers", type=int, default=None)
    r.add_argument("--max-shard-mb", type=float, default=None)
    r.add_argument("--with-mtp", action="store_true", help="add the MTP (nextn) layer model.layers.{L}.*")
    r.add_argument("--overwrite", action="store_true",
                   help="write into --out even when it is a non-empty directory that is not a random checkpoint "
                        "(files of the names written are replaced); an existing random checkpoint is replaced "
                        "(atomically) without it")
    r.set_defaults(fn=cmd_random_checkpoint)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the extra 'serve')")
    sv.add_argument("--checkpoint", required=True, help="HF safetensors or orbax (convert) directory")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=_port, default=8000, help="1..65535 (default 8000); checked before the model loads")
    sv.add_argument("--api-key", type=_non_empty, default=None,
                    help="require 'Authorization: Bearer KEY' on /v1 requests (not empty)")
    sv.add_argument("--served-model-name", default=None, help="the model id (default: the checkpoint's directory name)")
    sv.add_argument("--max-num-seqs", type=int, default=None, help="requests running at once (default 8)")
    sv.add_argument("--max-num-batched-tokens", type=int, default=None, help="rows per step (default 2048)")
    sv.add_argument("--num-pages", type=int, default=None,
                    help="KV cache pages per DCP rank (default: from the free device memory)")
    sv.add_argument("--block-size", type=int, default=None, help="tokens per KV cache page (default 16)")
    sv.add_argument("--max-request-bytes", type=_positive(int), default=None, metavar="BYTES",
                    help="the largest request body; larger ones get 413 before they are read (default: 16 bytes per "
                         "token of --max-model-len, room for its longest prompt as token ids or text, plus 4 MiB)")
    sv.add_argument("--shutdown-timeout", type=_non_negative_float, default=5.0, metavar="SECONDS",
                    help="on SIGTERM / SIGINT: stop accepting, let requests in flight run this long, then abort them "
                         "(streams end with finish_reason 'abort') and exit 0 (default 5)")
    sv.add_argument("--warmup-steps", action="store_true",
                    help="before accepting requests, compile the serving steps of every shape the loop can meet: "
                         "up to --max-num-batched-tokens rows, requests of up to --warmup-max-len tokens, greedy "
                         "and sampled (a shape met first while serving stalls every request for its compile: "
                         "seconds each on a GPU at full size); progress on stderr")
    sv.add_argument("--warmup-max-len", type=_positive(int), default=None, metavar="TOKENS",
                    help="with --warmup-steps: the longest request (prompt and output) whose steps are compiled "
                         "ahead (default --max-model-len; a smaller bound compiles fewer block-table widths)")
    _add_spec_flag(sv)
    _add_prefix_caching_flag(sv)
    _add_model_flags(sv)
    sv.set_defaults(fn=cmd_serve)

    c = sub.add_parser("convert", help="HF checkpoint (bf16 / fp32 / FP8 block-scaled) -> orbax checkpoint directory")
    c.add_argument("--from", dest="src", required=True, help="HF safetensors directory (or an orbax one)")
    c.add_argument("--to", dest="dst", required=True, help="orbax checkpoint directory (a new version is committed)")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="stored dtype (router, norms and indexer weights_proj stay float32)")
    _add_quantization_flag(c)
    c.add_argument("--no-progress", action="store_true")
    c.add_argument("--overwrite", action="store_true",
                   help="write into --to even when it is a non-empty directory that is not a glm-dsa orbax "
                        "checkpoint (config.json and tokenizer files there are replaced); an existing orbax "
                        "checkpoint is replaced (a new version committed atomically) without it")
    _add_parallel_flags(c)  # the mesh the parameters are staged on while converting (memory per device)
    _add_distributed_flags(c)
    c.set_defaults(fn=cmd_convert)

    b = sub.add_parser("bench", help="prefill/decode speed of a reduced-depth model with random weights")
    from glm_dsa.serving.benchmark import add_arguments as add_bench_arguments  # the flags live with the benchmark
    add_bench_arguments(b)
    b.add_argument("--num-speculative-tokens", default="", metavar="K[,K...]",
                   help="benchmark MTP instead: draft + verify step cost against plain decode for these draft "
                        "counts at --decode-batches, and B=1 tokens/s (glm_dsa/serving/benchmark.py)")
    b.set_defaults(fn=cmd_bench)

    t = sub.add_parser("trace", help="dump per-layer activations of one prompt to a .safetensors file")
    t.add_argument("--checkpoint", required=True)
    t.add_argument("--prompt-ids", type=_ids, required=True)
    t.add_argument("--out", required=True, help="output .safetensors")
    t.add_argument("--layers", default=None, help="comma-separated layer indices (default: all)")
    _add_model_flags(t)
    t.set_defaults(fn=cmd_trace)

    df = sub.add_parser("diff", help="compare two traces; names the first tensor beyond tolerance (exit 1)")
    df.add_argument("a")
    df.add_argument("b")
    df.add_argument("--rtol", type=float, default=1e-3)
    df.add_argument("--atol", type=float, default=1e-4)
    df.set_defaults(fn=cmd_diff)

    d = sub.add_parser("demo", help="write a small random GLM-5.2-shaped checkpoint, load it and generate")
    d.add_argument("--preset", default="demo", choices=["demo", "tiny"])
    d.add_argument("--out", default=None, help="where to write the checkpoint (default: a temp dir)")
    d.add_argument("--max-new-tokens", type=int, default=32)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--ignore-eos", action="store_true", default=True)
    d.set_defaults(fn=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = _run(args)
    except (Exception, KeyboardInterrupt):
        if _multiprocess():  # a peer waits in a collective for this process
            import traceback
            traceback.print_exc()
            from .distributed import exit_now
            exit_now(1)
        raise
    if status and _multiprocess():  # failed: not through JAX's shutdown barrier, where peers may wait long
        from .distributed import exit_now
        exit_now(status)
    return status


def _multiprocess() -> bool:
    if "jax" not in sys.modules:  # nothing has started the runtime (and --help need not import jax)
        return False
    from .distributed import is_multiprocess
    return is_multiprocess()


def _run(args) -> int:
    try:
        _use_compilation_cache(args)
        _start_distributed(args)
        return args.fn(args)
    except (ValueError, TypeError, OSError, NotImplementedError, ImportError, KeyError) as e:
        # user-facing failures (bad input, a bad or missing file, a missing extra): one line,
        # no traceback; ConfigError and CheckpointError are ValueErrors
        if os.environ.get("GLM_DSA_DEBUG"):
            raise  # the traceback, for whoever is debugging glm-dsa itself
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
