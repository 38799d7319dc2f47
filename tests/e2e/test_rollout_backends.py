"""Rollout backends on the tiny checkpoint: real vLLM (CPU) and transformers.

One backend of each kind serves the whole module (vLLM's engine takes ~20 s to start:
the session's, ``shared_vllm`` in tests/e2e/conftest.py, which test_lora's sync also
uses), driven from one event loop, as the rollout actor drives it. Every test that depends on
the weights first pushes its own payload, so none depends on the order the others ran
in. Log-probs are checked against an independent transformers forward pass over the
sampled tokens with the weights the test pushed: that proves at once that the payload
reached the engine's live model and that the behaviour log-probs are the ones the
trainer's importance ratio needs.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipeline.config import RolloutConfig
from pipeline.weights import WeightSyncError, compute_fingerprint, fingerprints_match, serialize_weights
from stages.rollout import build_backend
from stages.rollout.base import GenerationResult, SamplingSettings

PROMPTS = [[1, 5, 6, 7], [1, 20, 21], [1, 40, 41, 42, 43, 44], [1, 66]]
# float32 on both sides: measured max |diff| ~6e-7; 1e-4 leaves room for other CPUs.
LOGPROB_ATOL = 1e-4
SET_NUM_THREADS = torch.set_num_threads  # as torch made it, before any engine starts here


@pytest.fixture(scope="module")
def loop(rollout_loop):
    return rollout_loop


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


# The in-process engine core joins this process's torch.distributed world and tears it
# down at shutdown, which would break the DeepSpeed engines later tests build here: it
# runs in a pytest of its own (test_in_process_engine_core_passes_this_suite).
IN_PROCESS = os.environ.get("CONVEYOR_TEST_IN_PROCESS_ENGINE") == "1"


@pytest.fixture(scope="module", params=["vllm-in-process"] if IN_PROCESS else ["vllm", "hf"])
def backend(request, loop, checkpoint, shared_vllm):
    name, _, in_process = request.param.partition("-")
    if name == "vllm" and not in_process:  # the session's engine core in a process of its own
        yield shared_vllm.get()
        shared_vllm.close()  # its last user: no idle engine beside the tests after this module
        return
    cfg = RolloutConfig(backend=name, kv_cache_gib=0.25, seed=0,
                        engine_core="in_process" if in_process else "subprocess")
    backend = build_backend(name, checkpoint, cfg, "float32")
    loop.run_until_complete(backend.start())
    yield backend
    loop.run_until_complete(backend.shutdown())


def perturbed_weights(checkpoint, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """The checkpoint plus Gaussian noise (the tiny model's init std is 0.02)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in load_file(checkpoint / "model.safetensors").items()}


def reference_model(checkpoint, state_dict: dict[str, torch.Tensor]):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.load_state_dict(state_dict)
    return model


def recompute_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(tokens[t] | prompt, tokens[:t]) at temperature 1, by one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return torch.log_softmax(logits, dim=-1)[positions, torch.tensor(tokens)].tolist()


def push(loop, backend, state_dict: dict[str, torch.Tensor]) -> tuple[tuple[float, float], int]:
    version = backend.version + 1
    fingerprint = loop.run_until_complete(backend.update_weights(serialize_weights(state_dict), version))
    return fingerprint, version


def check_shapes(results: list[GenerationResult], sampling: SamplingSettings, versions: set[int]) -> None:
    assert [r.prompt_token_ids for r in results] == PROMPTS
    for result in results:
        assert len(result.completions) == sampling.n
        for c in result.completions:
            assert 1 <= len(c.token_ids) <= sampling.max_tokens
            assert len(c.logprobs) == len(c.token_ids) == len(c.token_versions)
            if sampling.logprobs:
                assert all(math.isfinite(lp) and lp <= 0.0 for lp in c.logprobs)
            else:
                assert all(math.isnan(lp) for lp in c.logprobs)
            assert set(c.token_versions) <= versions
            assert c.finish_reason in ("stop", "length")
            # "stop" ends with the tiny vocabulary's <eos> (id 2), included in the tokens.
            ends_with_eos = c.token_ids[-1] == 2
            assert (c.finish_reason == "stop") == ends_with_eos
            assert c.finish_reason == "stop" or len(c.token_ids) == sampling.max_tokens


def test_concurrent_calls_return_n_samples_with_behaviour_logprobs(loop, backend, checkpoint) -> None:
    state = perturbed_weights(checkpoint, seed=1, scale=0.01)
    _, version = push(loop, backend, state)
    sampling = SamplingSettings(n=4, temperature=1.0, max_tokens=12, seed=7)

    async def run_concurrently():
        return await asyncio.gather(*[backend.generate(PROMPTS, sampling) for _ in range(3)])

    calls = loop.run_until_complete(run_concurrently())
    model = reference_model(checkpoint, state)
    for results in calls:
        check_shapes(results, sampling, {version})
        for prompt, result in zip(PROMPTS, results, strict=True):
            for c in result.completions:
                expected = recompute_logprobs(model, prompt, c.token_ids)
                assert max(abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)) < LOGPROB_ATOL
    # Samples of one prompt differ (each has its own seed), so the group is not degenerate.
    assert len({tuple(c.token_ids) for c in calls[0][0].completions}) > 1


def test_logprobs_are_those_of_the_processed_distribution(loop, backend) -> None:
    # top_k=1 leaves one token with probability 1: its processed log-prob is exactly 0,
    # whereas the raw log-prob of a near-uniform 89-token model is about -4.5.
    sampling = SamplingSettings(n=2, temperature=1.0, top_k=1, max_tokens=6)
    results = loop.run_until_complete(backend.generate(PROMPTS, sampling))
    check_shapes(results, sampling, {backend.version})
    assert all(abs(lp) < 1e-6 for r in results for c in r.completions for lp in c.logprobs)
    greedy = loop.run_until_complete(backend.generate(PROMPTS, SamplingSettings(n=1, temperature=0.0, max_tokens=6)))
    assert [r.completions[0].token_ids for r in results] == [g.completions[0].token_ids for g in greedy]


def test_min_tokens_holds_every_completion_to_its_length(loop, backend) -> None:
    """A row's budget (``bench longtail``: min = max) gives exact lengths. The control
    shows the test can fail: the near-uniform tiny model samples <eos> (1 of 89 tokens)
    often enough that without the minimum some of 32 samples stop before 40 tokens
    (all 32 reach it with probability (88/89)^(40*32) < 1e-6). transformers generates
    slowly on a CPU: its backend gets a shorter check."""
    n = 40 if backend.__class__.__name__ == "VLLMBackend" else 12
    if n == 40:
        free = loop.run_until_complete(backend.generate(PROMPTS, SamplingSettings(n=8, max_tokens=n)))
        assert any(len(c.token_ids) < n for r in free for c in r.completions)
    held = loop.run_until_complete(backend.generate(PROMPTS, SamplingSettings(n=8, max_tokens=n, min_tokens=n)))
    assert {len(c.token_ids) for r in held for c in r.completions} == {n}
    assert {c.finish_reason for r in held for c in r.completions} == {"length"}


def test_without_logprobs_the_same_samples_come_with_nan_in_their_place(loop, backend) -> None:
    """``rollout.logprobs: false``: the engine is asked for no log-probs; with the same
    seeds it draws the very tokens it draws with them, and every log-prob is NaN."""
    with_them = SamplingSettings(n=3, temperature=1.0, max_tokens=10, seed=11)
    without = SamplingSettings(n=3, temperature=1.0, max_tokens=10, seed=11, logprobs=False)
    first = loop.run_until_complete(backend.generate(PROMPTS, with_them))
    second = loop.run_until_complete(backend.generate(PROMPTS, without))
    check_shapes(second, without, {backend.version})
    assert [[c.token_ids for c in r.completions] for r in second] == [[c.token_ids for c in r.completions] for r in first]
    check_shapes(first, with_them, {backend.version})


def test_update_weights_is_verified_and_changes_greedy_output(loop, backend, checkpoint) -> None:
    greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=16)
    before_state = perturbed_weights(checkpoint, seed=2, scale=0.0)
    push(loop, backend, before_state)
    before = loop.run_until_complete(backend.generate(PROMPTS, greedy))

    after_state = perturbed_weights(checkpoint, seed=3, scale=0.05)
    fingerprint, version = push(loop, backend, after_state)
    assert backend.version == version
    assert fingerprints_match(fingerprint, compute_fingerprint(after_state.values()))
    assert not fingerprints_match(fingerprint, compute_fingerprint(before_state.values()))
    assert fingerprints_match(loop.run_until_complete(backend.live_fingerprint()), fingerprint)

    after = loop.run_until_complete(backend.generate(PROMPTS, greedy))
    check_shapes(after, greedy, {version})
    assert [r.completions[0].token_ids for r in after] != [r.completions[0].token_ids for r in before]
    with pytest.raises(ValueError, match="older"):
        loop.run_until_complete(backend.update_weights(serialize_weights(after_state), version - 1))


def test_unverified_update_returns_the_payload_fingerprint_and_can_be_checked_later(loop, backend, checkpoint) -> None:
    """``verify=False`` (``train.weight_sync_monitor: false``) skips the read-back; what
    it returns is the payload's fingerprint, which the live weights then match."""
    state = perturbed_weights(checkpoint, seed=6, scale=0.03)
    version = backend.version + 1
    fingerprint = loop.run_until_complete(backend.update_weights(serialize_weights(state), version, verify=False))
    assert backend.version == version
    assert fingerprints_match(fingerprint, compute_fingerprint(state.values()))
    assert fingerprints_match(loop.run_until_complete(backend.live_fingerprint()), fingerprint)


def test_update_in_flight_tags_every_token_with_the_weights_that_sampled_it(loop, backend, checkpoint) -> None:
    _check_update_in_flight(loop, backend, checkpoint, seeds=(4, 5))
    if backend.__class__.__name__ == "VLLMBackend" and backend._output_mode == "labels":
        # The path of a vLLM without version labels (the GPU image's 0.26): versions
        # from the split points marked at each update, checked the same way.
        backend._output_mode = "splits"
        try:
            _check_update_in_flight(loop, backend, checkpoint, seeds=(7, 8))
        finally:
            backend._output_mode = "labels"


def _check_update_in_flight(loop, backend, checkpoint, seeds: tuple[int, int]) -> None:
    old_state = perturbed_weights(checkpoint, seed=seeds[0], scale=0.01)
    new_state = perturbed_weights(checkpoint, seed=seeds[1], scale=0.01)
    _, old = push(loop, backend, old_state)
    long = SamplingSettings(n=8, temperature=1.0, max_tokens=120, seed=11)

    async def update_mid_generation():
        start = backend.tokens_generated
        task = asyncio.ensure_future(backend.generate(PROMPTS, long))
        # Update as soon as the first tokens of the long requests have arrived (vLLM), or
        # after the whole call (HF: it applies updates between calls only).
        while backend.tokens_generated == start:
            await asyncio.sleep(0.001)
        await backend.update_weights(serialize_weights(new_state), old + 1)
        return await task

    results = loop.run_until_complete(update_mid_generation())
    new = old + 1
    check_shapes(results, long, {old, new})
    old_model, new_model = reference_model(checkpoint, old_state), reference_model(checkpoint, new_state)
    switched = 0
    for prompt, result in zip(PROMPTS, results, strict=True):
        for c in result.completions:
            assert c.token_versions == sorted(c.token_versions)
            switched += len(set(c.token_versions)) == 2
            under_old = recompute_logprobs(old_model, prompt, c.token_ids)
            under_new = recompute_logprobs(new_model, prompt, c.token_ids)
            for lp, v, a, b in zip(c.logprobs, c.token_versions, under_old, under_new, strict=True):
                assert abs(lp - (a if v == old else b)) < LOGPROB_ATOL
    if backend.__class__.__name__ == "VLLMBackend":
        # 32 completions of up to 120 tokens and the update lands a step or two after
        # their first token: some are still generating (each stops with p ~ 1/89 a token).
        assert switched > 0
    else:
        assert switched == 0  # HF applies updates between generate calls only


def test_an_update_recomputes_the_requests_in_flight_unless_told_to_keep_their_kv(loop, backend, checkpoint) -> None:
    """rollout.recompute_on_update: an update mid-generation drops every KV block, and vLLM
    recomputes the requests in flight (counted by the scheduler as preemptions); false keeps
    them on the KV they have, and nothing is recomputed. Read where vLLM's scheduler can be
    (the in-process engine core); the others report no engine stats."""
    import msgspec

    if getattr(backend, "engine_stats", lambda: None)() is None:
        assert getattr(backend, "engine_core", None) != "in_process"
        return
    long = SamplingSettings(n=8, temperature=1.0, max_tokens=120, seed=13)
    cfg = backend.cfg

    def preempted_by_an_update(recompute: bool, seed: int) -> int:
        backend.cfg = msgspec.structs.replace(cfg, recompute_on_update=recompute)
        before = backend.engine_stats()

        async def update_mid_generation():
            start = backend.tokens_generated
            task = asyncio.ensure_future(backend.generate(PROMPTS, long))
            while backend.tokens_generated == start:
                await asyncio.sleep(0.001)
            await backend.update_weights(serialize_weights(perturbed_weights(checkpoint, seed, 0.01)),
                                         backend.version + 1)
            return await task

        results = loop.run_until_complete(update_mid_generation())
        assert any(len(set(c.token_versions)) == 2 for r in results for c in r.completions)  # some spanned it
        after = backend.engine_stats()
        recomputed = after["update_recomputes"] - before["update_recomputes"]
        # The KV cache holds all of them here: every preemption is the update's recompute.
        assert recomputed == after["preemptions"] - before["preemptions"], (before, after)
        return recomputed

    try:
        assert preempted_by_an_update(True, seed=14) > 0
        assert preempted_by_an_update(False, seed=15) == 0
    finally:
        backend.cfg = cfg


def test_a_bad_payload_never_serves_unverified_weights(loop, backend, checkpoint) -> None:
    good = perturbed_weights(checkpoint, seed=6, scale=0.01)
    good_fp, old = push(loop, backend, good)
    sampling = SamplingSettings(n=1, temperature=0.0, max_tokens=4)

    misshaped = dict(good, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(WeightSyncError, match="wrong shapes"):
        loop.run_until_complete(backend.update_weights(serialize_weights(misshaped), old + 1))
    # Refused before loading: the old weights keep serving under the old version.
    assert backend.version == old
    assert fingerprints_match(loop.run_until_complete(backend.live_fingerprint()), good_fp)
    results = loop.run_until_complete(backend.generate(PROMPTS, sampling))
    assert {v for r in results for v in r.completions[0].token_versions} == {old}

    incomplete = {k: v + 0.01 for k, v in good.items() if k != "model.norm.weight"}
    with pytest.raises(WeightSyncError):
        loop.run_until_complete(backend.update_weights(serialize_weights(incomplete), old + 1))
    assert backend.version == old
    try:
        results = loop.run_until_complete(backend.generate(PROMPTS, sampling))
    except WeightSyncError:
        pass  # vLLM: loaded in part, unverified, so generation stays paused
    else:  # HF: refused before copying, so the old weights still serve
        assert fingerprints_match(loop.run_until_complete(backend.live_fingerprint()), good_fp)
        assert {v for r in results for v in r.completions[0].token_versions} == {old}

    fingerprint, new = push(loop, backend, good)  # a good update recovers either way
    assert fingerprints_match(fingerprint, good_fp) and backend.version == new
    results = loop.run_until_complete(backend.generate(PROMPTS, sampling))
    assert {v for r in results for v in r.completions[0].token_versions} == {new}


def test_the_engine_reports_the_kv_cache_it_made(backend, checkpoint) -> None:
    """Rollout admission's KV budget is the cache the engine made: vLLM's blocks hold the
    0.25 GiB asked for, to within a block, in this model's float32 bytes per token; the
    HF backend preallocates none and reports none."""
    import json

    from pipeline.memory.admission import ModelShape, estimate_kv_cache_bytes
    from stages.rollout.vllm_backend import VLLMBackend

    tokens = getattr(backend, "kv_cache_tokens", lambda: None)()
    if not isinstance(backend, VLLMBackend):
        assert tokens is None
        return
    shape = ModelShape.from_hf_config(json.loads((checkpoint / "config.json").read_text()), dtype_bytes=4)
    made, asked = estimate_kv_cache_bytes(shape, tokens), 0.25 * (1 << 30)
    assert 0.95 * asked <= made <= asked, (tokens, made, asked)


def test_the_engine_runs_a_batch_as_vllms_offline_llm_does(loop, backend) -> None:
    """Rollout is batch generation: the engine holds as many running sequences and tokens
    a step as vLLM's offline ``LLM`` would (vLLM's server defaults, 128 sequences, ran
    256-sequence steps in two waves). The in-process engine core accounts for its steps
    (with the sequences unfinished at each); the subprocess one reports none."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from stages.rollout.vllm_backend import VLLMBackend

    if not isinstance(backend, VLLMBackend):
        return
    batched, seqs = EngineArgs.get_batch_defaults(world_size=1)
    scheduler = backend._engine.vllm_config.scheduler_config
    assert seqs[UsageContext.LLM_CLASS] > seqs[UsageContext.OPENAI_API_SERVER]  # else this proves nothing
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (
        seqs[UsageContext.LLM_CLASS], batched[UsageContext.LLM_CLASS])
    before = backend.engine_stats()
    results = loop.run_until_complete(backend.generate(PROMPTS, SamplingSettings(n=4, max_tokens=8)))
    after = backend.engine_stats()
    if backend.engine_core != "in_process":
        assert before is None and after is None
        return
    lengths = [len(c.token_ids) for r in results for c in r.completions]
    steps = after["steps"] - before["steps"]
    # A step samples a token for every running sequence: at least the longest completion's
    # steps, and far fewer than one a token (16 sequences in one batch).
    assert max(lengths) <= steps < sum(lengths) / 2, (steps, lengths)
    assert after["step_s"] > before["step_s"] and after["mean_requests"] > 0
    # vLLM's scheduler was read after every step: the batch held KV blocks, and a 0.25 GiB
    # cache for 16 short sequences, with no weight update meanwhile, preempted none of them
    # (earlier tests' updates did: each recomputes the requests in flight).
    assert 0 < after["kv_usage_max"] <= 1 and after["preemptions"] == before["preemptions"], (before, after)


def test_the_model_runs_where_the_engine_core_says(backend) -> None:
    """On CPU the in-process engine core runs the model in this process too (vLLM's uni
    executor), starting no vLLM process, and leaves torch.set_num_threads as it was
    (vLLM's CPU worker replaces it for its process); the subprocess engine core is a vLLM
    process of its own; the HF backend starts none."""
    import psutil

    from stages.rollout.vllm_backend import VLLMBackend

    vllm_processes = [p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]
    if not isinstance(backend, VLLMBackend) or backend.engine_core == "in_process":
        assert vllm_processes == []
        assert torch.set_num_threads is SET_NUM_THREADS
        torch.set_num_threads(torch.get_num_threads())  # still torch's own: no warning, no error
    else:
        assert "VLLM::EngineCore" in vllm_processes, vllm_processes


def test_hf_backend_ignores_the_checkpoints_sampling_penalties(loop, checkpoint, tmp_path) -> None:
    """A checkpoint whose generation_config asks for penalties and truncation: the HF
    backend's behaviour log-probs stay those of the plain softmax (what the trainer
    scores), not of a penalised distribution."""
    import json
    import shutil

    penalised = tmp_path / "penalised"
    shutil.copytree(checkpoint, penalised)
    gen = penalised / "generation_config.json"
    settings = json.loads(gen.read_text()) if gen.exists() else {}
    settings.update(repetition_penalty=10.0, min_p=0.5, no_repeat_ngram_size=1, top_k=3)
    gen.write_text(json.dumps(settings))
    backend = build_backend("hf", penalised, RolloutConfig(backend="hf", seed=0), "float32")
    loop.run_until_complete(backend.start())
    try:
        sampling = SamplingSettings(n=4, temperature=1.0, max_tokens=12, seed=3)
        results = loop.run_until_complete(backend.generate(PROMPTS, sampling))
    finally:
        loop.run_until_complete(backend.shutdown())
    model = AutoModelForCausalLM.from_pretrained(penalised, dtype=torch.float32).eval()
    for prompt, result in zip(PROMPTS, results, strict=True):
        for c in result.completions:
            expected = recompute_logprobs(model, prompt, c.token_ids)
            assert max(abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)) < LOGPROB_ATOL


@pytest.mark.slow  # this suite again in a subprocess; the GPU tier runs the in-process core, the default there
def test_in_process_engine_core_passes_this_suite() -> None:
    """Every test above on rollout.engine_core: in_process, in a fresh process."""
    env = {**os.environ, "CONVEYOR_TEST_IN_PROCESS_ENGINE": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "not test_in_process_engine_core_passes_this_suite"],
                         env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout
