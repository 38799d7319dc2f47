"""Pure parts of the rollout backends: registry, sampling settings, engine arguments,
per-token versions, rank fingerprints and payload checks. No engine is started."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from pipeline.config import RolloutConfig
from pipeline.weights import (
    WeightSyncError,
    check_payload_fits,
    compute_fingerprint,
    read_checkpoint_shapes,
    read_payload_shapes,
    serialize_weights,
)
from stages.rollout import BACKENDS, build_backend, resolve_backend
from stages.rollout.base import SamplingSettings, build_sampling_settings, check_version_order
from stages.rollout.hf_backend import check_payload_names, cut_at_stop, group_prompts_by_length
from stages.rollout.vllm_backend import (
    COMPILE_OFF,
    WORKER_EXTENSION,
    build_engine_kwargs,
    describe_compile,
    expand_version_spans,
    list_compile_cache,
    plan_cpu_binding,
    resolve_engine_core,
)
from stages.rollout.vllm_worker_ext import WeightSyncExtension, combine_rank_fingerprints, read_packed_linear_weight


class FakeBackend:
    """A plug-in backend, named in tests by ``tests.unit.test_rollout_core:FakeBackend``."""

    def __init__(self, model_path, rollout_cfg, dtype):
        self.args = (model_path, rollout_cfg, dtype)

    @property
    def version(self) -> int:
        return 0

    async def start(self): ...
    async def generate(self, prompt_token_ids, sampling): ...
    async def update_weights(self, data, version): ...
    async def live_fingerprint(self): ...
    async def shutdown(self): ...


def build_not_a_backend(model_path, rollout_cfg, dtype) -> object:
    return object()


def test_build_backend_accepts_an_import_path_and_rejects_the_rest() -> None:
    cfg = RolloutConfig()
    backend = build_backend("tests.unit.test_rollout_core:FakeBackend", Path("/m"), cfg, "float32")
    assert isinstance(backend, FakeBackend) and backend.args == (Path("/m"), cfg, "float32")
    with pytest.raises(ValueError, match="expected one of"):
        resolve_backend("nonsense")
    with pytest.raises(ValueError, match="no attribute"):
        resolve_backend("tests.unit.test_rollout_core:Missing")
    with pytest.raises(ValueError, match="lacks the RolloutBackend methods"):
        build_backend("tests.unit.test_rollout_core:build_not_a_backend", Path("/m"), cfg, "float32")
    assert set(BACKENDS) == {"vllm", "hf"}


def test_importing_the_registry_imports_no_engine() -> None:
    code = "import sys, stages.rollout; print('vllm' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_sampling_settings_are_validated() -> None:
    cfg = RolloutConfig(n=4, temperature=0.7, top_p=0.9, top_k=20, max_tokens=5)
    s = build_sampling_settings(cfg, seed=3)
    assert (s.n, s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed) == (4, 0.7, 0.9, 20, 5, 3)
    assert SamplingSettings(temperature=0.0).greedy and not s.greedy
    for bad in (dict(n=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=0), dict(max_tokens=0)):
        with pytest.raises(ValueError, match="sampling"):
            SamplingSettings(**bad)


def test_versions_never_go_back() -> None:
    check_version_order(3, 3)
    check_version_order(3, 4)
    with pytest.raises(ValueError, match="older"):
        check_version_order(3, 2)


def test_engine_kwargs_on_cpu_and_gpu() -> None:
    cfg = RolloutConfig(kv_cache_gib=0.25, gpu_memory_utilization=0.4, tensor_parallel_size=2, seed=9)
    cpu = build_engine_kwargs(Path("/ckpt"), cfg, "bfloat16", on_cpu=True)
    assert cpu["kv_cache_memory_bytes"] == 268435456  # 0.25 * 2**30
    assert "gpu_memory_utilization" not in cpu
    assert (cpu["dtype"], cpu["seed"], cpu["tensor_parallel_size"]) == ("bfloat16", 9, 2)
    assert cpu["logprobs_mode"] == "processed_logprobs"
    assert cpu["enforce_eager"] is True
    gpu = build_engine_kwargs(Path("/ckpt"), cfg, "auto", on_cpu=False)
    assert gpu["gpu_memory_utilization"] == 0.4 and gpu["kv_cache_memory_bytes"] == 268435456
    assert gpu["enforce_eager"] is False  # unset: CUDA graphs on a GPU
    # Tensor parallel on GPUs: vLLM's workers are the rollout actor's child processes.
    assert gpu["distributed_executor_backend"] == "mp" and "distributed_executor_backend" not in cpu
    one = build_engine_kwargs(Path("/ckpt"), msgspec.structs.replace(cfg, tensor_parallel_size=1), "auto", on_cpu=False)
    assert "distributed_executor_backend" not in one
    # Unset: the CPU engine's 1 GiB; on a GPU the share sizes the cache unless a size is given.
    unset = msgspec.structs.replace(cfg, kv_cache_gib=None)
    assert build_engine_kwargs(Path("/ckpt"), unset, "auto", on_cpu=True)["kv_cache_memory_bytes"] == 1 << 30
    assert "kv_cache_memory_bytes" not in build_engine_kwargs(Path("/ckpt"), unset, "auto", on_cpu=False)
    sized = build_engine_kwargs(Path("/ckpt"), msgspec.structs.replace(cfg, kv_cache_gib=3.75), "auto", on_cpu=False)
    assert sized["kv_cache_memory_bytes"] == int(3.75 * (1 << 30)) and sized["gpu_memory_utilization"] == 0.4
    assert "max_model_len" not in sized  # the model's own unless set
    capped = build_engine_kwargs(Path("/ckpt"), msgspec.structs.replace(cfg, max_model_len=192), "auto", on_cpu=False)
    assert capped["max_model_len"] == 192
    forced = build_engine_kwargs(Path("/ckpt"), msgspec.structs.replace(cfg, enforce_eager=True), "auto", on_cpu=False)
    assert forced["enforce_eager"] is True
    # An older vLLM without kv_cache_memory_bytes: the field is dropped (the env takes
    # over); without logprobs_mode the behaviour log-probs would be wrong: refuse.
    old = build_engine_kwargs(Path("/ckpt"), cfg, "auto", on_cpu=True, supported=set(cpu) - {"kv_cache_memory_bytes"})
    assert old == {k: v for k, v in cpu.items() if k != "kv_cache_memory_bytes"} | {"dtype": "auto"}
    with pytest.raises(RuntimeError, match="logprobs_mode"):
        build_engine_kwargs(Path("/ckpt"), cfg, "auto", on_cpu=True, supported=set(cpu) - {"logprobs_mode"})
    # rollout.engine_kwargs pass through; a name this vLLM lacks is refused, named.
    extra = msgspec.structs.replace(cfg, engine_kwargs={"max_num_batched_tokens": 8192, "async_scheduling": True})
    passed = build_engine_kwargs(Path("/ckpt"), extra, "auto", on_cpu=False,
                                 supported=set(gpu) | {"max_num_batched_tokens", "async_scheduling"})
    assert passed == gpu | {"max_num_batched_tokens": 8192, "async_scheduling": True}
    with pytest.raises(ValueError, match=r"rollout.engine_kwargs.async_scheduling: not an engine argument"):
        build_engine_kwargs(Path("/ckpt"), extra, "auto", on_cpu=False, supported=set(gpu) | {"max_num_batched_tokens"})
    # rollout.max_num_seqs (the launch plans it) becomes vLLM's; unset, vLLM's own default.
    assert "max_num_seqs" not in gpu
    seqs = build_engine_kwargs(Path("/ckpt"), msgspec.structs.replace(cfg, max_num_seqs=64), "auto", on_cpu=False)
    assert seqs == gpu | {"max_num_seqs": 64}
    # rollout.compile off (the default): vLLM's compilation config without torch.compile,
    # full decode graphs kept; nothing where the engine is eager anyway (the CPU,
    # enforce_eager). on: vLLM's own.
    assert gpu["compilation_config"] == COMPILE_OFF
    on = build_engine_kwargs(Path("/ckpt"), msgspec.structs.replace(cfg, compile="on"), "auto", on_cpu=False)
    assert on == {k: v for k, v in gpu.items() if k != "compilation_config"}
    off = msgspec.structs.replace(cfg, compile="off")
    assert "compilation_config" not in build_engine_kwargs(Path("/ckpt"), off, "auto", on_cpu=True)
    eager_off = msgspec.structs.replace(off, enforce_eager=True)
    assert "compilation_config" not in build_engine_kwargs(Path("/ckpt"), eager_off, "auto", on_cpu=False)
    import vllm.config as vllm_config
    parsed = vllm_config.CompilationConfig(**COMPILE_OFF)  # the names this vLLM takes
    assert (parsed.mode, parsed.cudagraph_mode) == (vllm_config.CompilationMode.NONE,
                                                    vllm_config.CUDAGraphMode.FULL_DECODE_ONLY)
    module, _, name = WORKER_EXTENSION.rpartition(".")
    ext = getattr(__import__(module, fromlist=[name]), name)
    assert callable(ext.apply_weights) and callable(ext.fingerprint)


def test_auto_engine_core_is_in_process_without_tensor_parallelism() -> None:
    assert resolve_engine_core("auto", tensor_parallel_size=1) == "in_process"
    assert resolve_engine_core("auto", tensor_parallel_size=2) == "subprocess"
    assert resolve_engine_core("subprocess", tensor_parallel_size=1) == "subprocess"
    assert resolve_engine_core("in_process", tensor_parallel_size=1) == "in_process"


def test_version_spans_expand_to_one_version_per_token() -> None:
    spans = [SimpleNamespace(version="3", start=0, end=2), SimpleNamespace(version="4", start=2, end=5)]
    assert expand_version_spans(spans, 5) == [3, 3, 4, 4, 4]
    assert expand_version_spans(spans, 6) is None  # does not cover the tokens
    assert expand_version_spans([SimpleNamespace(version="default", start=0, end=1)], 1) is None
    assert expand_version_spans(None, 0) is None


def test_rank_fingerprints_count_replicated_parameters_once() -> None:
    # Two tensor-parallel ranks: the norm is replicated (same numbers), qkv is sharded.
    rank0 = {"norm.weight": (4.0, 4.0), "qkv.weight": (1.0, 2.0)}
    rank1 = {"norm.weight": (4.0, 4.0), "qkv.weight": (-3.0, 5.0)}
    # norm once: (4, 4); qkv summed: (1 - 3, 2 + 5) = (-2, 7); total (2, 11).
    assert combine_rank_fingerprints([rank0, rank1]) == (2.0, 11.0)
    assert combine_rank_fingerprints([rank0]) == (5.0, 6.0)


def test_packed_linear_weight_is_read_back_through_its_kernel() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)  # [out, in]
    layer = SimpleNamespace(
        weight=torch.nn.Parameter(torch.empty(0), requires_grad=False),  # what vLLM leaves
        input_size_per_partition=5,
        cpu_linear=lambda x, weight, bias: torch.nn.functional.linear(x, w, bias),
    )
    chunks = list(read_packed_linear_weight(layer, rows=2))  # 5 inputs in chunks 2, 2, 1
    assert [tuple(c.shape) for c in chunks] == [(2, 6), (2, 6), (1, 6)]
    assert torch.equal(torch.cat(chunks), w.t())
    assert compute_fingerprint(chunks) == compute_fingerprint([w])


def test_payload_shapes_are_read_from_the_header_alone(tmp_path) -> None:
    sd = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    data = serialize_weights(sd)
    assert read_payload_shapes(data) == {"a": (2, 3), "b": (4,)}
    (tmp_path / "model.safetensors").write_bytes(data)
    assert read_checkpoint_shapes(tmp_path) == {"a": (2, 3), "b": (4,)}
    with pytest.raises(WeightSyncError, match="too short"):
        read_payload_shapes(b"\x01")
    with pytest.raises(WeightSyncError, match="claims"):
        read_payload_shapes(data[:20])


def test_payload_must_fit_the_model() -> None:
    expected = {"a": (2, 3), "b": (4,), "lm_head": (4, 2)}
    check_payload_fits({"a": (2, 3), "b": (4,)}, expected)  # a missing alias is allowed here
    with pytest.raises(WeightSyncError, match=r"unknown names \['c'\]"):
        check_payload_fits({"a": (2, 3), "c": (1,)}, expected)
    with pytest.raises(WeightSyncError, match=r"b \(5,\) != \(4,\)"):
        check_payload_fits({"b": (5,)}, expected)


def test_hf_payload_names_accept_either_name_of_a_tied_parameter() -> None:
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(5, 2)
    model.head = torch.nn.Linear(2, 5, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.norm = torch.nn.LayerNorm(2)
    full = {"embed.weight": torch.zeros(5, 2), "norm.weight": torch.ones(2), "norm.bias": torch.zeros(2)}
    check_payload_names(model, full)
    check_payload_names(model, {"head.weight": torch.zeros(5, 2), "norm.weight": torch.ones(2), "norm.bias": torch.zeros(2)})
    with pytest.raises(WeightSyncError, match=r"missing parameters \['norm.bias'\]"):
        check_payload_names(model, {k: v for k, v in full.items() if k != "norm.bias"})
    with pytest.raises(WeightSyncError, match="wrong shapes"):
        check_payload_names(model, dict(full, **{"norm.weight": torch.ones(3)}))
    with pytest.raises(WeightSyncError, match=r"unknown names \['extra'\]"):
        check_payload_names(model, dict(full, extra=torch.ones(1)))


def test_completions_stop_after_the_first_stop_token() -> None:
    assert cut_at_stop([5, 6, 2, 7, 0], {2}) == ([5, 6, 2], "stop")
    assert cut_at_stop([5, 6, 7], {2}) == ([5, 6, 7], "length")
    assert group_prompts_by_length([[1, 2], [3], [4, 5], [6]]) == {2: [0, 2], 1: [1, 3]}


def test_worker_fingerprint_counts_a_tied_parameter_once() -> None:
    """``lm_head.weight`` *is* ``embed_tokens.weight`` in a tied model: one Parameter
    reached from two modules. The payload carries it once, so the live fingerprint
    must count it once too (counting it per module broke every tied family)."""
    embed = torch.nn.Embedding(3, 2)
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 0.0]]))
    head.weight = embed.weight  # tied, as vLLM ties ParallelLMHead to the embedding
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.tensor([0.5, 0.5]))
    model = torch.nn.ModuleDict({"embed_tokens": embed, "norm": norm, "lm_head": head})
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model))
    out = WeightSyncExtension.fingerprint(worker)
    # embed once: sum 1+2+0-1+3+0 = 5, squares 1+4+0+1+9+0 = 15; norm: (1.0, 0.5).
    assert out == {"embed_tokens.weight": (5.0, 15.0), "norm.weight": (1.0, 0.5)}
    assert combine_rank_fingerprints([out]) == (6.0, 15.5)


def test_split_points_expand_to_one_version_per_token() -> None:
    from stages.rollout.vllm_backend import expand_splits

    assert expand_splits([(0, 3)], 4) == [3, 3, 3, 3]
    assert expand_splits([(0, 3), (2, 4)], 5) == [3, 3, 4, 4, 4]
    # Added during an update (split at 0): every token under the new version.
    assert expand_splits([(0, 5)], 2) == [5, 5]
    # Two updates while in flight, the second before any new token came.
    assert expand_splits([(0, 1), (3, 2), (6, 3)], 7) == [1, 1, 1, 2, 2, 2, 3]
    assert expand_splits([(0, 1)], 0) == []


def test_sampled_logprobs_are_read_from_the_flat_and_the_classic_form() -> None:
    from vllm.logprobs import FlatLogprobs, Logprob

    from stages.rollout.vllm_backend import build_sampling_params
    from stages.rollout.vllm_common import read_sampled_logprobs
    from stages.rollout.vllm_sampler_tap import SampledLogprobs

    positions = [{7: Logprob(-0.5, rank=1)}, {3: Logprob(-1.25, rank=2)}]
    flat = FlatLogprobs()
    for position in positions:
        flat.append(position)
    assert read_sampled_logprobs(flat, [7, 3]) == [-0.5, -1.25]
    assert read_sampled_logprobs(positions, [7, 3]) == [-0.5, -1.25]
    # The sampled token must be the one the log-prob belongs to, in either form.
    with pytest.raises(ValueError, match="one per sampled token"):
        read_sampled_logprobs(flat, [7, 4])
    with pytest.raises(KeyError):
        read_sampled_logprobs(positions, [7, 4])
    # One log-prob missing: the request fails instead of shifting the rest.
    with pytest.raises(ValueError):
        read_sampled_logprobs(positions[:1], [7, 3])
    params = build_sampling_params(SamplingSettings(n=1, temperature=1.0, max_tokens=4), None, final_only=True)
    assert params.flat_logprobs and params.logprobs == 0
    # rollout.logprobs: false: none asked of the engine, NaN in their place, nothing read.
    params = build_sampling_params(SamplingSettings(max_tokens=4, logprobs=False), None, final_only=True)
    assert params.logprobs is None
    assert all(math.isnan(x) for x in read_sampled_logprobs(None, [7, 3], requested=False))
    assert len(read_sampled_logprobs(None, [7, 3], requested=False)) == 2
    # The sampler tap reports them: none asked of vLLM, read as asked, in vLLM's flat form.
    params = build_sampling_params(SamplingSettings(max_tokens=4), None, final_only=True, tapped=True)
    assert params.logprobs is None
    assert read_sampled_logprobs(SampledLogprobs([7, 3], [-0.5, -1.25]), [7, 3]) == [-0.5, -1.25]
    with pytest.raises(ValueError, match="one per sampled token"):
        read_sampled_logprobs(SampledLogprobs([7, 3], [-0.5]), [7, 3])


def test_tensor_parallel_cpu_workers_get_disjoint_cores() -> None:
    assert plan_cpu_binding([0, 1], 2) == "0|1"
    assert plan_cpu_binding([0, 1, 2, 3, 4], 2) == "0,1,2|3,4"  # 5 = 3 + 2, the first run one more
    assert plan_cpu_binding([2, 5, 7, 8], 2) == "2,5|7,8"  # the cores allowed, not a range
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size: 2 CPU workers need 2 cores, 1 allowed"):
        plan_cpu_binding([0], 2)


def test_keeping_kv_across_updates_turns_the_prefix_cache_off_and_refuses_it_on() -> None:
    """rollout.recompute_on_update false: requests in flight keep old-weight KV, so no new
    request may start on cached blocks (vLLM's prefix cache off); asking for it back is refused."""
    from pipeline.config import ConfigError, load_config

    kept = build_engine_kwargs(Path("/ckpt"), RolloutConfig(recompute_on_update=False), "auto", on_cpu=False)
    assert kept["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in build_engine_kwargs(Path("/ckpt"), RolloutConfig(), "auto", on_cpu=False)
    with pytest.raises(ConfigError, match="rollout.engine_kwargs.enable_prefix_caching.*recompute_on_update"):
        load_config(None, ["rollout.recompute_on_update=false", 'rollout.engine_kwargs={"enable_prefix_caching": true}'])


def test_the_compile_cache_lists_each_entry_and_aot_ones_one_level_down(tmp_path: Path) -> None:
    assert list_compile_cache(tmp_path) == set()  # no cache yet
    for entry in ("a1b2c3d4e5", "torch_aot_compile/f00d", "torch_aot_compile/beef"):
        (tmp_path / "torch_compile_cache" / entry).mkdir(parents=True)
    assert list_compile_cache(tmp_path) == {"a1b2c3d4e5", "torch_aot_compile/f00d", "torch_aot_compile/beef"}


def _compiled(seconds: float, cache_dir: str = "", local_cache_dir: str = "") -> SimpleNamespace:
    return SimpleNamespace(compilation_config=SimpleNamespace(
        compilation_time=seconds, cache_dir=cache_dir, local_cache_dir=local_cache_dir))


@pytest.mark.parametrize("before, expected", [
    (set(), {"compile": 61.5}),  # a cold cache: compiled afresh
    ({"0123456789"}, {"compile": 61.5}),  # another model's entry
    ({"a1b2c3d4e5"}, {"compile_cached": 61.5}),  # this config's entry was there
])
def test_the_engine_says_whether_it_compiled_or_loaded_its_compile(before, expected) -> None:
    config = _compiled(61.5, cache_dir="/root/.cache/vllm/torch_compile_cache/a1b2c3d4e5")
    assert describe_compile(config, before) == expected


def test_an_ahead_of_time_compile_is_matched_by_its_own_entry() -> None:
    config = _compiled(4.2, local_cache_dir="/c/torch_compile_cache/torch_aot_compile/f00d")
    assert describe_compile(config, {"torch_aot_compile/f00d"}) == {"compile_cached": 4.2}
    assert describe_compile(config, {"torch_aot_compile/beef"}) == {"compile": 4.2}


@pytest.mark.parametrize("config", [None, _compiled(0.0), SimpleNamespace(compilation_config=None)])
def test_an_engine_that_compiled_nothing_here_reports_no_compile(config) -> None:
    # Eager (CPU), or the engine core in a process of its own: no figure, not a zero.
    assert describe_compile(config, {"a1b2c3d4e5"}) == {}


def test_the_rollout_start_up_counts_compile_apart_from_the_engine() -> None:
    import asyncio
    import time

    from stages.rollout.stage import RolloutStage

    class CompilingBackend:
        def __init__(self) -> None:
            self.compile_phase = {"compile": 0.02}

        async def start(self) -> None:
            time.sleep(0.05)  # the engine's start, compile included

        async def generate(self, prompts, sampling):
            return []

    stage = object.__new__(RolloutStage)
    stage._new_backend, stage.colocated = CompilingBackend, False
    stage.tokenizer = lambda text, add_special_tokens: {"input_ids": [1]}
    stage.sampling = SamplingSettings(max_tokens=4)
    phases: dict[str, float] = {}
    asyncio.run(stage._start_backend(phases))
    assert list(phases) == ["engine", "compile", "warm_up"]
    assert phases["compile"] == 0.02 and phases["engine"] + phases["compile"] >= 0.05


def test_kv_admission_at_the_cap_names_how_few_samples_generate_and_the_keys():
    """Qwen3-0.6B's KV cache (112 KiB a token) at 20 GiB with a 16,384-token cap: about
    ten samples at once where vLLM was planned for 512, and the warning names the keys;
    none where the cap fits the plan or prompts carry their own budgets."""
    from pipeline.memory.admission import ModelShape
    from stages.rollout.stage import describe_kv_admission

    qwen3 = ModelShape(num_layers=28, num_kv_heads=8, head_dim=128, hidden_size=1024, vocab_size=151_936,
                       num_params=6 * 10**8, dtype_bytes=2, intermediate_size=3072, num_heads=16, qk_norm=True)
    budget = int(0.85 * 20 * 2**30)
    most, why = describe_kv_admission(qwen3, budget, 64 + 16_384, 512, own_budgets=False)
    assert most == budget // (114_688 * 16_448) == 9
    assert why is not None and "at most 9 samples" in why and "of the 512" in why
    assert "rollout.max_tokens" in why and "rollout.kv_reserve=observed" in why and "rollout.kv_reserve=none" in why
    assert describe_kv_admission(qwen3, budget, 64 + 16_384, 512, own_budgets=True) == (9, None)
    most, why = describe_kv_admission(qwen3, budget, 64 + 512, 256, own_budgets=False)
    assert most == 276 and why is None


def test_observed_kv_reserve_takes_the_smaller_of_a_samples_budget_and_the_p90():
    from stages.rollout.stage import reserve_completion

    assert reserve_completion(16_384, None) == 16_384  # "cap", or too few completions yet
    assert reserve_completion(16_384, 3_558) == 3_558
    assert reserve_completion(700, 3_558) == 700  # a prompt's own smaller budget stands
    assert reserve_completion(700, 0) == 1


@pytest.mark.parametrize(("backend", "kv_reserve", "policy"), [
    ("vllm", "auto", "none"),  # vLLM's paged cache schedules itself: nothing reserved
    ("hf", "auto", "cap"),  # a cache that grows with what it is given: the whole budget
    ("my_pkg.engine:Backend", "auto", "cap"),
    ("vllm", "cap", "cap"), ("hf", "none", "none"), ("vllm", "observed", "observed"),
])
def test_kv_reserve_auto_leaves_vllms_cache_to_its_scheduler_and_reserves_elsewhere(backend, kv_reserve, policy):
    assert RolloutConfig(backend=backend, kv_reserve=kv_reserve).kv_reserve_policy == policy
