"""The HF loader's multi-process path (`checkpoints.loader._load_local_shards`): a process reads, per device of
its own, just that device's slice of the stored tensors (never a whole tensor), and the slices assemble into the
same parameters as the single-process path."""

import numpy as np

import checkpoints.loader as loader
from checkpoints.random import write_random_checkpoint
from glm_dsa import ParallelConfig, configs
from glm_dsa.model.loading import param_sharding
from glm_dsa.model.step import resolve_parallel

CFG = configs.tiny.replace(num_attention_heads=8)


class _Spy:
    """A stored tensor that records (its key, the size of a slice read, its own size) for every read."""

    def __init__(self, key, arr, log):
        self.key, self.arr, self.log = key, arr, log

    def __getitem__(self, idx):
        out = self.arr[idx]
        self.log.append((self.key, out.size, self.arr.size))
        return out


def test_each_device_reads_only_its_slice(tmp_path, monkeypatch):
    write_random_checkpoint(CFG, tmp_path, seed=1, dtype="float32", progress=False)
    par = resolve_parallel(ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=2), CFG)
    whole = loader.load_hf_params(tmp_path, CFG, dtype="float32", sharding_for=param_sharding(par), progress=False)
    ckpt = loader.HFCheckpoint(tmp_path)
    log = []
    raw = ckpt.raw
    monkeypatch.setattr(ckpt, "raw", lambda key: _Spy(key, raw(key), log))
    sharding_for = param_sharding(par)
    split = 0
    for name, spec in loader.param_specs(CFG).items():
        sharding = sharding_for(name, spec.shape)
        log.clear()
        got = loader._load_local_shards(ckpt, spec, np.dtype(np.float32), sharding)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(whole[name]), err_msg=name)
        n_slices = len({tuple((s.start, s.stop) for s in idx)
                        for idx in sharding.addressable_devices_indices_map(spec.shape).values()})
        if n_slices > 1:  # a split parameter: each read is a part of a tensor, no element is read twice
            split += 1
            assert all(size < total for _, size, total in log), name
            for key in spec.hf_keys:
                sizes = [size for k, size, _ in log if k == key]
                assert sum(sizes) <= ckpt.raw(key).arr.size, (name, key)
    assert split > 10
