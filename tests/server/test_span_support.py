"""What span mode refuses, and that it refuses when the engine is built — not at the first
request — plus the runner hooks (V1 and Model Runner V2) and the worker-side model check."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from torch import nn

from span_vllm import patches
from span_vllm.rotation import CpuKeyLayout, PagedKeyLayout, RopeRotator
from span_vllm.support import UnsupportedModelError, engine_problems, kv_cache_problems
from span_vllm.worker import WorkerRotation, build_rotation

BLOCK = 16


def _full(**changes):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    fields = dict(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16)
    fields.update(changes)
    return FullAttentionSpec(**fields)


def _config(*specs, num_blocks: int = 32):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _sliding():
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                             dtype=torch.float16, sliding_window=128)


def _mla():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                            dtype=torch.float16)


def test_one_full_attention_group_is_supported_float_or_fp8() -> None:
    from vllm.v1.kv_cache_interface import KVQuantMode

    assert kv_cache_problems(_config(_full())) == []
    assert kv_cache_problems(_config(_full(dtype=torch.bfloat16))) == []
    fp8 = _full(dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    assert kv_cache_problems(_config(fp8)) == []


@pytest.mark.parametrize(("specs", "reason"), [
    (lambda: [_full(), _sliding()], "2 KV cache groups"),
    (lambda: [_sliding()], "SlidingWindowSpec"),
    (lambda: [_mla()], "MLAAttentionSpec"),
    (lambda: [_full(sliding_window=64)], "sliding-window"),
    (lambda: [_full(non_causal=True)], "non-causal"),
    (lambda: [_full(head_size_v=32)], "head sizes differ"),
    (lambda: [], "0 KV cache groups"),
])
def test_other_kv_caches_are_refused_with_the_reason(specs, reason: str) -> None:
    problems = kv_cache_problems(_config(*specs()))
    assert problems and reason in " ".join(problems)


@pytest.mark.parametrize("mode", ["INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD", "NVFP4",
                                  "INT4_PER_TOKEN_HEAD", "TURBOQUANT_K8V4"])
def test_quantized_caches_other_than_per_tensor_fp8_are_refused(mode: str) -> None:
    from vllm.v1.kv_cache_interface import KVQuantMode

    spec = _full(dtype=torch.uint8, kv_quant_mode=KVQuantMode[mode])
    assert any(mode in p for p in kv_cache_problems(_config(spec)))


def test_context_parallel_and_connectors_are_refused() -> None:
    assert kv_cache_problems(_config(_full()), dcp_world_size=2)
    config = types.SimpleNamespace(
        kv_transfer_config=object(),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1,
                                              prefill_context_parallel_size=2),
        attention_config=types.SimpleNamespace(hisparse_config=object()),
        model_config=types.SimpleNamespace(uses_mrope=True, is_encoder_decoder=False),
    )
    text = " ".join(engine_problems(config))
    for word in ("KV connector", "prefill-context-parallel", "HiSparse", "MRoPE"):
        assert word in text


def test_data_parallel_engines_are_refused_when_the_scheduler_is_built() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    patches._patch_start_checks()
    config = types.SimpleNamespace(
        kv_transfer_config=None,
        parallel_config=types.SimpleNamespace(data_parallel_size=2),
    )
    with pytest.raises(UnsupportedModelError, match="data-parallel-size 2"):
        Scheduler(config, _config(_full()), None, BLOCK)


def test_the_launcher_refuses_data_parallel_before_starting_anything(capsys) -> None:
    from span_workflows.serving import app as api

    with pytest.raises(SystemExit) as info:
        api.main(["--model", "/nonexistent", "--data-parallel-size", "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data-parallel-size 2" in err[0]


def _manager(config):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK,
                          hash_block_size=BLOCK, enable_caching=True)


def test_a_hybrid_model_is_refused_when_its_kv_cache_manager_is_built() -> None:
    patches._patch_start_checks()  # what the plugin does at start (idempotent)
    with pytest.raises(UnsupportedModelError, match="KV cache groups") as info:
        _manager(_config(_full(), _sliding(), num_blocks=64))
    assert info.value.stage == "KV cache manager"
    manager = _manager(_config(_full(), num_blocks=64))
    assert manager._span_tracker.block_size == BLOCK  # tracker ready before any request


def test_the_scheduler_refuses_a_kv_connector_before_building_anything(monkeypatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    patches._patch_start_checks()
    config = types.SimpleNamespace(kv_transfer_config=object())
    with pytest.raises(UnsupportedModelError, match="KV connector"):
        Scheduler(config, _config(_full()), None, BLOCK)



def _store_config(tmp_path, *, tp: int = 1, pp: int = 1, algo: str = "sha256"):
    """An engine configuration with the span store (only what the checks read)."""
    from span_vllm.contract import store_transfer_config

    transfer = types.SimpleNamespace(**store_transfer_config(tmp_path / "store"))
    return types.SimpleNamespace(
        kv_transfer_config=transfer,
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp,
                                              pipeline_parallel_size=pp,
                                              world_size=tp * pp),
        cache_config=types.SimpleNamespace(prefix_caching_hash_algo=algo, block_size=BLOCK),
        model_config=types.SimpleNamespace(model=str(tmp_path / "model"), uses_mrope=False,
                                           is_encoder_decoder=False),
        device_config=types.SimpleNamespace(device_type="cuda"),
    )


@pytest.mark.parametrize(("tp", "pp", "flag"), [(2, 1, "--tensor-parallel-size 2"),
                                                (1, 2, "--pipeline-parallel-size 2"),
                                                (4, 2, "--tensor-parallel-size 4")])
def test_the_span_store_is_refused_under_tensor_or_pipeline_parallelism(
        tmp_path, tp: int, pp: int, flag: str) -> None:
    """Each rank holds its own slice of a block's KV (heads or layers) while a store file is
    named by the block hash alone: ranks would overwrite and read each other's slices. The
    store is refused at start on more than one rank (and allowed on one)."""
    assert engine_problems(_store_config(tmp_path)) == []
    problems = engine_problems(_store_config(tmp_path, tp=tp, pp=pp))
    assert len(problems) == 1 and "span store" in problems[0] and flag in problems[0]
    config = _store_config(tmp_path, tp=tp, pp=pp)
    config.kv_transfer_config = None  # without a store, tensor/pipeline parallelism is fine
    assert engine_problems(config) == []


def test_two_ranks_never_open_one_store(tmp_path) -> None:
    """The connector itself (built in every worker, before the scheduler's check) refuses to
    open a store on more than one rank: no rank writes a slice another reads."""
    from span_vllm.store_connector import store_for

    kv_cache_config = _config(_full())
    store, writes = store_for(_store_config(tmp_path), kv_cache_config)
    assert writes and store.directory.is_dir()
    with pytest.raises(UnsupportedModelError, match="tensor-parallel-size 2"):
        store_for(_store_config(tmp_path / "tp", tp=2), kv_cache_config)
    assert not (tmp_path / "tp" / "store").exists()


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_the_span_store_is_refused_where_vllms_first_hash_is_random(
        tmp_path, monkeypatch, algo: str) -> None:
    """With a non-cryptographic prefix hash vLLM seeds its first block's parent (NONE_HASH)
    at random in every process unless PYTHONHASHSEED is set: another process would never find
    a stored block. Refused at start, naming the option; allowed with PYTHONHASHSEED set."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    problems = engine_problems(_store_config(tmp_path, algo=algo))
    assert len(problems) == 1
    assert f"--prefix-caching-hash-algo {algo}" in problems[0]
    assert "PYTHONHASHSEED" in problems[0]
    assert engine_problems(_store_config(tmp_path, algo="sha256")) == []
    assert engine_problems(_store_config(tmp_path, algo="sha256_cbor")) == []
    config = _store_config(tmp_path, algo=algo)
    config.kv_transfer_config = None
    assert engine_problems(config) == []  # without a store nothing crosses processes
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert engine_problems(_store_config(tmp_path, algo=algo)) == []


def test_the_random_first_hash_algorithms_are_vllms() -> None:
    """The plugin's list of algorithms with a per-process random NONE_HASH is vLLM's."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from span_vllm.support import RANDOM_FIRST_HASH_ALGOS

    assert {get_hash_fn_by_name(name) for name in RANDOM_FIRST_HASH_ALGOS} == set(
        kv_cache_utils._NON_CRYPTO_HASH_FUNCTIONS)


class _Recorder:
    """A worker rotation that records what it was asked to rotate, and the cache then."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.cache, self.calls = cache, []

    def apply(self, moves) -> None:
        self.calls.append((list(moves), self.cache.clone()))


def _v2_runner(cache: torch.Tensor, num_blocks: int):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2

    runner = object.__new__(RunnerV2)  # only what update_requests reads
    runner.req_states = types.SimpleNamespace(
        num_computed_tokens_np=np.zeros(1, np.int32), req_id_to_index={},
        prefill_len=types.SimpleNamespace(np=np.zeros(1, np.int32)),
        num_computed_prefill_tokens=np.zeros(1, np.int32))
    runner.block_tables = None
    runner.kv_block_zeroer = None
    runner.kv_caches = [cache]
    runner.kv_cache_config = types.SimpleNamespace(num_blocks=num_blocks)
    return runner


def test_model_runner_v2_rotates_after_vllms_block_copies_before_the_forward() -> None:
    """The V2 hook runs vLLM's own ``update_requests`` (which applies copy-on-write block
    copies), then the step's rotations: a copied block is rotated as a copy."""
    patches._patch_worker()
    cache = torch.randn(8, 2, BLOCK, 128)
    runner = _v2_runner(cache, 8)
    runner._span_rotation = recorder = _Recorder(cache)
    output = types.SimpleNamespace(
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], num_computed_tokens=[],
                                                    new_block_ids=[]),
        new_block_ids_to_zero=[], kv_cache_block_copies=[(3, 6)],
        span_rotations=[(6, 40)])
    source = cache[3].clone()
    runner.update_requests(output)
    assert len(recorder.calls) == 1
    moves, seen = recorder.calls[0]
    assert moves == [(6, 40)]
    assert torch.equal(seen[6], source)  # the copy had happened when the rotation ran
    runner.update_requests(types.SimpleNamespace(**{**vars(output), "span_rotations": []}))
    assert len(recorder.calls) == 1  # nothing to rotate, nothing called


def _cpu_runner(backend: str = "CPU_ATTN", isa: str = "vec", kv_dtype: str = "auto",
                rope=None, num_blocks: int = 6):
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.v1.kv_cache_interface import KVQuantMode

    quant = KVQuantMode.FP8_PER_TENSOR if kv_dtype.startswith("fp8") else KVQuantMode.NONE
    spec = _full(head_size=64, dtype=torch.uint8 if quant.name != "NONE" else torch.float32,
                 kv_quant_mode=quant, block_size=32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    rope = rope or get_rope(64, 4096, rope_parameters={"rope_theta": 1e5})
    model = nn.Module()
    model.layers = nn.ModuleList()
    context = {}
    for name in names:
        owner = nn.Module()
        owner.attn = nn.Module()
        owner.attn.layer_name = name
        owner.attn.kv_cache = torch.zeros(num_blocks, 2, 32, 128, dtype=spec.dtype)
        owner.attn.isa = isa
        owner.rotary_emb = rope
        model.layers.append(owner)
        context[name] = owner.attn
    group = types.SimpleNamespace(backend=types.SimpleNamespace(get_name=lambda: backend))
    return types.SimpleNamespace(
        kv_cache_config=config, attn_groups=[[group]], model=model,
        vllm_config=types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(static_forward_context=context),
            cache_config=types.SimpleNamespace(cache_dtype=kv_dtype)))


@pytest.fixture
def _vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.mark.usefixtures("_vllm_config")
def test_worker_check_builds_the_rotation_of_a_supported_cpu_model() -> None:
    rotation = build_rotation(_cpu_runner())
    assert isinstance(rotation, WorkerRotation)
    assert isinstance(rotation.layout, CpuKeyLayout) and len(rotation.caches) == 2
    assert rotation.fp8 is None and rotation.rope.rotary_dim == 64
    expected = RopeRotator.from_base(1e5, 64).inv_freq
    assert torch.allclose(rotation.rotator.inv_freq, expected, rtol=1e-6)


@pytest.mark.usefixtures("_vllm_config")
@pytest.mark.parametrize(("runner", "reason"), [
    (lambda: _cpu_runner(backend="FLEX_ATTENTION"), "FLEX_ATTENTION"),
    (lambda: _cpu_runner(isa="amx"), "amx"),
    (lambda: _cpu_runner(kv_dtype="fp8"), "fp8 KV cache on cpu"),
])
def test_worker_check_refuses_what_it_cannot_rotate_exactly(runner, reason: str) -> None:
    with pytest.raises(UnsupportedModelError, match=reason) as info:
        build_rotation(runner())
    assert info.value.stage == "worker model check"


@pytest.mark.usefixtures("_vllm_config")
def test_worker_check_refuses_an_unsupported_rope_at_start() -> None:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    mrope = get_rope(64, 4096, rope_parameters={"rope_theta": 1e6,
                                                "mrope_section": [8, 12, 12]})
    with pytest.raises(UnsupportedModelError, match="MRoPE"):
        build_rotation(_cpu_runner(rope=mrope))


def test_paged_layout_is_what_cuda_backends_get() -> None:
    layout = PagedKeyLayout(64, num_blocks=4)
    with pytest.raises(ValueError, match="paged KV cache"):
        layout.keys(torch.zeros(5, 2, 16, 128))  # 5 kernel blocks cannot be 4 blocks
