"""The long-tail bench's pure parts: the length schedule, the tail-wait figure, the
per-row budget from data row to sampling settings, and TRL's per-request hook (on a fake
vLLM ``LLM``, since TRL and a GPU are absent here)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench.longtail import compute_ratios, parse_systems
from bench.longtail_lengths import LengthSchedule, write_prompt_file
from bench.longtail_trl import install_budgets
from pipeline.config import ConfigError, load_config
from pipeline.types import Prompt
from stages.data.files import RowError
from stages.data.prompt_rows import ColumnMap, extract_row, resolve_columns
from stages.rollout.base import SamplingSettings, apply_budget
from stages.rollout.occupancy import OccupancyMeter, compute_tail_wait, integrate_events, summarize_length_counts
from stages.rollout.stage import group_by_budget


def test_the_schedule_is_lognormal_with_its_median_and_p99_and_clipped_to_its_cap():
    lens = np.array(LengthSchedule().lengths(20_000))
    # Lognormal with median 1024 and p99 8192 (sigma = ln 8 / 2.326 = 0.894): the sample
    # quantiles of 20k draws sit within a few percent of the targets.
    assert abs(np.median(lens) / 1024 - 1) < 0.05
    assert abs(np.percentile(lens, 99) / 8192 - 1) < 0.10
    assert lens.max() <= 16384 and lens.min() >= 32
    assert (lens == 16384).mean() < 0.002  # P(z > ln 16 / 0.894 = 3.1) ~ 0.001: the cap bites rarely
    # The tail is heavy: the mean (1024 * exp(0.894^2 / 2) = 1522) is well above the median.
    assert abs(lens.mean() / 1522 - 1) < 0.05


def test_a_prompts_length_depends_on_its_index_and_the_seed_only():
    s = LengthSchedule(seed=3)
    assert s.lengths(50) == [LengthSchedule(seed=3).length(i) for i in range(50)]  # same on every call
    assert s.lengths(10) == s.lengths(200)[:10]  # asking for more never changes earlier ones
    assert s.lengths(50) != LengthSchedule(seed=4).lengths(50)
    # --scale keeps the shape: each length is the full one times the factor, to rounding.
    half = LengthSchedule(seed=3, scale=0.5)
    assert all(abs(h - f / 2) <= 1 for h, f in zip(half.lengths(200), s.lengths(200), strict=True))
    with pytest.raises(ValueError, match="--scale"):
        LengthSchedule(scale=0)


def test_the_prompt_file_holds_each_rows_length_as_both_bounds(tmp_path):
    s = LengthSchedule(scale=1 / 64)
    rows = [{"prompt": f"{i}=", "ground_truth": str(i), "data_source": "copy"} for i in range(5)]
    lines = [json.loads(x) for x in write_prompt_file(rows, s, tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["max_tokens"] for r in lines] == [r["min_tokens"] for r in lines] == s.lengths(5)


def test_tail_wait_of_a_lockstep_step_is_the_time_after_its_median_sample_ended():
    # Five samples start at t=0 and end at 1, 2, 3, 4 and 10. In flight: 5 for 1 s, 4, 3
    # and 2 for 1 s each, 1 for 6 s. Fewer than 0.5 x 5 = 2.5 in flight from t=3 (the
    # median, third, sample's end) to t=10: 7 of 10 s.
    levels = integrate_events([(0, 5), (1, -1), (2, -1), (3, -1), (4, -1), (10, -1)])
    assert levels == {5: 1.0, 4: 1.0, 3: 1.0, 2: 1.0, 1: 6.0}
    tail = compute_tail_wait(levels)
    assert tail["tail_s"] == pytest.approx(7.0) and tail["tail_share"] == pytest.approx(0.7)
    assert tail["peak_in_flight"] == 5 and tail["generating_s"] == pytest.approx(10.0)
    # mean occupancy: (5 + 4 + 3 + 2 + 6 * 1) / 10 s / 5 slots = 0.4
    assert tail["mean_occupancy"] == pytest.approx(0.4)


def test_streaming_that_refills_the_engine_has_no_tail_and_idle_time_is_not_tail():
    # Each sample that ends is replaced at once: 4 in flight from 0 to 9 (a swap takes no
    # time), none from 9 to 12 (idle: waiting for prompts or weights, not for a tail),
    # then 2 for a second (2 is not below 0.5 x 4) and 1 for a second (the only tail).
    events = [(0, 4), *[(t, d) for k in range(1, 9) for t, d in ((k, -1), (k, 1))], (9, -4), (12, 2), (13, -1),
              (14, -1)]
    tail = compute_tail_wait(integrate_events(events))
    assert tail["tail_s"] == pytest.approx(1.0) and tail["tail_share"] == pytest.approx(1 / 11)
    assert tail["idle_s"] == pytest.approx(3.0)
    assert tail["generating_s"] == pytest.approx(11.0)
    # Keys read back from JSON are strings.
    assert compute_tail_wait({"4": 9.0, "1": 1.0}) == compute_tail_wait({4: 9.0, 1: 1.0})


def test_the_meter_refuses_to_count_below_zero_and_reports_up_to_now():
    m = OccupancyMeter()
    m.add(2, 0.0)
    with pytest.raises(ValueError, match="only 2 samples in flight"):
        m.remove(3, 1.0)
    assert m.seconds_at(now=4.0) == {2: 4.0} and m.seconds_at() == {}


def test_length_counts_give_exact_quantiles():
    # 98 samples of length 10, one of 500, one of 900: median 10; the 99th sample (p99
    # needs 99 of 100 at or below) is 500; max 900.
    out = summarize_length_counts({10: 98, "500": 1, 900: 1})
    assert out == {"samples": 100, "mean": (980 + 500 + 900) / 100, "median": 10, "p90": 10, "p99": 500, "max": 900}


def _cmap(**kw):
    return ColumnMap(max_tokens="max_tokens", min_tokens="min_tokens", **kw)


def test_a_rows_budget_is_read_and_a_bad_value_names_the_row_and_field():
    assert extract_row({"prompt": "1=", "max_tokens": 40, "min_tokens": 40}, _cmap(), "r")["max_tokens"] == 40
    assert extract_row({"prompt": "1=", "max_tokens": 40.0, "min_tokens": None}, _cmap(), "r")["min_tokens"] is None
    for bad, field in (({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "12"}, "max_tokens"),
                       ({"max_tokens": True}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"),
                       ({"max_tokens": 2.5}, "max_tokens")):
        with pytest.raises(RowError, match=f"data.jsonl row 7: field '{field}' must be a whole number") as err:
            extract_row({"prompt": "1=", **bad}, _cmap(), "data.jsonl row 7")
        assert err.value.reason == "malformed"
    with pytest.raises(RowError, match="row 3: field 'min_tokens' \\(9\\) is above field 'max_tokens' \\(4\\)"):
        extract_row({"prompt": "1=", "max_tokens": 4, "min_tokens": 9}, _cmap(), "row 3")
    with pytest.raises(ConfigError, match="data.max_tokens_field: f.jsonl has no column 'budget'"):
        resolve_columns(["prompt"], "prompt", "ground_truth", "f.jsonl", budget=("budget", None))
    # The budget columns are read (Parquet decodes only the columns asked for).
    assert "max_tokens" in _cmap().columns and _cmap().columns.count("max_tokens") == 1


def test_the_config_takes_budget_fields():
    cfg = load_config(None, ["data.max_tokens_field=n", "data.min_tokens_field=n"])
    assert (cfg.data.max_tokens_field, cfg.data.min_tokens_field) == ("n", "n")
    with pytest.raises(ConfigError, match="max_tokens_field"):
        load_config(None, ["data.max_tokens_field="])


def test_a_budget_is_clamped_to_the_rollouts_maximum_and_prompts_of_one_budget_share_a_call():
    base = SamplingSettings(n=4, max_tokens=100)
    assert apply_budget(base, None, None) is base
    assert (apply_budget(base, 30, 30).max_tokens, apply_budget(base, 30, 30).min_tokens) == (30, 30)
    assert (apply_budget(base, 500, 400).max_tokens, apply_budget(base, 500, 400).min_tokens) == (100, 100)
    with pytest.raises(ValueError, match="sampling.min_tokens"):
        SamplingSettings(max_tokens=4, min_tokens=5)
    prompts = [Prompt(prompt_id=f"p{i}", text="1=", max_tokens=m, min_tokens=m) for i, m in
               enumerate([30, 500, 30, None, 100])]
    groups = [(s.max_tokens, s.min_tokens, idx) for s, idx in group_by_budget(prompts, base)]
    # 500 clamps to 100, the same budget as prompt 4's; None is the rollout's own (no minimum).
    assert groups == [(30, 30, [0, 2]), (100, 100, [1, 4]), (100, 0, [3])]


def test_vllm_requests_carry_the_minimum():
    from stages.rollout.vllm_backend import build_sampling_params

    params = build_sampling_params(SamplingSettings(max_tokens=12, min_tokens=12), seed=None)
    assert (params.max_tokens, params.min_tokens) == (12, 12)


class FakeParams:
    """A stand-in for vLLM's SamplingParams: what TRL's call passes."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens, self.min_tokens = max_tokens, 0

    def clone(self) -> FakeParams:
        out = FakeParams(self.max_tokens)
        out.min_tokens = self.min_tokens
        return out


class FakeLLM:
    """A stand-in for vLLM's ``LLM``: ``generate`` steps a fake engine until every
    request is done, one token per step, and records the params it was given."""

    class Output:
        def __init__(self, n: int, finished: bool) -> None:
            self.outputs = [type("C", (), {"token_ids": list(range(n))})()]
            self.finished = finished

    def __init__(self) -> None:
        self.seen: list[FakeParams] = []
        self.llm_engine = type("Engine", (), {})()
        self.llm_engine.step = self._step
        self._left: list[int] = []

    def _step(self) -> list[FakeLLM.Output]:
        self._left = [n - 1 for n in self._left]
        done = [self.Output(0, True) for n in self._left if n == 0]
        self._left = [n for n in self._left if n > 0]
        return done

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        self.seen = params
        self._left = [p.max_tokens for p in params]
        while self._left:
            self.llm_engine.step()
        return [self.Output(p.max_tokens, True) for p in params]


def test_trls_generate_call_gets_one_request_per_prompt_with_its_length():
    class Table:
        def lookup(self, ids):
            return {(1, 2): 3, (1, 5): 7}[tuple(ids)]

    llm, meter, lengths = FakeLLM(), OccupancyMeter(), {}
    install_budgets(llm, Table(), meter, lengths)
    llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 5]}, {"prompt_token_ids": [1, 2]}],
                 sampling_params=FakeParams(16), use_tqdm=False)
    assert [(p.max_tokens, p.min_tokens) for p in llm.seen] == [(3, 3), (7, 7), (3, 3)]
    assert lengths == {3: 2, 7: 1}
    assert meter.level == 0 and meter.peak == 3
    with pytest.raises(KeyError):
        llm.generate([{"prompt_token_ids": [9]}], sampling_params=FakeParams(16))


def test_rows_and_ratios():
    assert parse_systems("streaming,lockstep[rollout.max_inflight=8],trl") == (
        ("streaming", ()), ("lockstep", ("rollout.max_inflight=8",)), ("trl", ()))
    for bad in ("async", "trl[a=1]", "verl[a=1]", "lockstep[oops]"):
        with pytest.raises(ValueError, match="--systems"):
            parse_systems(bad)
    rows = {"streaming": {"spec": "streaming", "status": "ok", "samples_per_s": 30.0, "tail_share": 0.1,
                          "time_to_threshold_s": {"0.5": 40.0}},
            "lockstep": {"spec": "lockstep", "status": "ok", "samples_per_s": 10.0, "tail_share": 0.6,
                         "time_to_threshold_s": {"0.5": 100.0}},
            "colocate": {"spec": "colocate", "status": "ok", "samples_per_s": 15.0},
            "trl": {"spec": "trl", "status": "skipped"},
            "verl": {"spec": "verl", "status": "ok", "samples_per_s": 12.0}}
    r = compute_ratios(rows, reward=True)
    # The peers are TRL and verl; Conveyor's own colocate row (15.0) is not one: 30 / 12.
    assert r["streaming_over_lockstep"] == 3.0 and r["fastest_peer"] == "verl"
    assert r["streaming_over_fastest_peer"] == 2.5 and r["streaming_over_trl"] is None
    assert r["streaming_over_verl"] == 2.5
    assert r["streaming_time_to_reward_over_lockstep"] == 0.4 and r["lockstep_tail_share"] == 0.6
    assert not math.isnan(r["streaming_samples_per_s"])
    assert "kv_budget_gib" not in r  # rows without an admission account


def test_ratios_name_conveyor_rows_that_generated_with_different_kv_caches():
    """A lock-step row whose vLLM made a smaller cache than the streaming row's: the ratios say so."""
    rows = {"streaming": {"spec": "streaming", "status": "ok", "samples_per_s": 7.5,
                          "rollout_admission": [{"budget_gib": 18.3}]},
            "lockstep": {"spec": "lockstep", "status": "ok", "samples_per_s": 5.2,
                         "rollout_admission": [{"budget_gib": 12.7}]},
            "trl": {"spec": "trl", "status": "ok", "samples_per_s": 2.0}}
    r = compute_ratios(rows, reward=False)
    assert r["kv_budget_gib"] == {"streaming": 18.3, "lockstep": 12.7}
    assert r["kv_budget_warning"].startswith("lockstep's rollout had a KV budget of 12.7 GiB against streaming's 18.3")
    rows["lockstep"]["rollout_admission"] = [{"budget_gib": 9.0}, {"budget_gib": 8.5}]  # two replicas: summed
    r = compute_ratios(rows, reward=False)
    assert r["kv_budget_gib"]["lockstep"] == 17.5 and "kv_budget_warning" not in r


def test_trls_prompts_are_found_by_the_token_ids_trl_makes_of_them():
    from bench.longtail_trl import BudgetTable
    from stages.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer("qwen3")  # has a chat template, as the real shapes do
    rows = [{"prompt": [{"role": "user", "content": "123="}], "max_tokens": 5},
            {"prompt": [{"role": "user", "content": "4123="}], "max_tokens": 9}]
    table = BudgetTable(tok, rows)
    # TRL tokenizes a conversational prompt with apply_chat_template(tokenize=True).
    ids = tok.apply_chat_template([rows[1]["prompt"]], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"][0]
    assert table.lookup(ids) == 9 and table.matched == {"ids": 1, "text": 0}
    plain = BudgetTable(tok, [{"prompt": "77=", "max_tokens": 4}])
    assert plain.lookup(tok("77=")["input_ids"]) == 4
    with pytest.raises(KeyError, match="does not know"):
        table.lookup(tok("999=")["input_ids"])


def test_the_verl_row_without_verl_or_a_gpu_is_skipped_with_its_reason(tmp_path):
    from bench.longtail import run_rows

    rows = run_rows(job=None, specs=(("verl", ()),), root=tmp_path, on_gpu=False, warmup=1)
    assert rows["verl"]["status"] == "skipped"
    assert "verl" in rows["verl"]["error"]


def test_verl_trains_in_passes_and_checkpoints_as_the_conveyor_rows_do(tmp_path, monkeypatch):
    """verl's defaults (8 samples a pass, checkpointing on) are not what Conveyor's rows run:
    its job takes the config's token budget a pass and its checkpointing."""
    import bench.longtail as lt
    import bench.peers.verl_grpo as vg

    jobs = []
    monkeypatch.setattr(vg, "run_verl", lambda vjob, rows, root, warmup: jobs.append(vjob) or {})
    (tmp_path / "p.jsonl").write_text('{"prompt": "1=", "ground_truth": "1", "max_tokens": 4}\n')
    for extra, budget, ckpt in (((), 16384, False),
                                (("train.pass_tokens=0", "train.gradient_checkpointing=true"), None, True)):
        job = lt.Job(lt.CONFIG, 2, LengthSchedule(scale=1 / 64), "tiny", 1, tmp_path / "p.jsonl", extra)
        lt.run_verl_row(job, tmp_path / "verl", warmup=1)
        assert (jobs[-1].token_budget, jobs[-1].gradient_checkpointing) == (budget, ckpt)
    assert jobs[-1].micro_batch_samples == load_config(lt.CONFIG).train.chunk_size


def test_a_repeated_row_records_its_overrides_among_the_results_systems(tmp_path):
    from bench.longtail import _payload, run_rows

    specs = (("colocate", ()), ("colocate", ("train.gather_micro_batches=1", "run.seed=1")))
    rows = run_rows(job=None, specs=specs, root=tmp_path, on_gpu=False, warmup=1)  # skipped: no GPU
    assert list(rows) == ["colocate", "colocate#2"]
    payload = _payload(rows, {}, {}, [], quick=True, pending=[])
    assert payload["params"]["systems"] == ["colocate", "colocate[train.gather_micro_batches=1;run.seed=1]"]


def test_a_streaming_row_that_placement_auto_colocated_is_an_error():
    """On a GPU too small for the streaming plan, ``placement: auto`` runs the job
    colocated and lock-step: the streaming row would measure lock-step twice."""
    from bench.common import check_row_streamed

    check_row_streamed("streaming", {"mode": "async"})
    with pytest.raises(RuntimeError, match=r"streaming row ran 'sync'.*streaming\[train.gradient_checkpointing=true\]"):
        check_row_streamed("streaming", {"mode": "sync"})


def test_a_rows_rollout_admission_is_read_from_its_replicas_counters():
    """The guard's ``admission/<stage>/*`` counters and ``memory/<stage>/*`` bytes, whatever
    the replica's stage name; its other status fields are left out."""
    from bench.longtail import summarize_rollout_admission

    result = {"state": "generating", "samples": 512, "oom_protection": True, "kv_reserve": "cap", "kv_cache_gib": 3.5,
              "admission/rollout:1/admitted": 40.0, "admission/rollout:1/deferred": 7.0,
              "admission/rollout:1/splits": 3.0, "admission/rollout:1/calibration": 1.0,
              "memory/rollout:1/budget_bytes": 3 * 2**30, "memory/rollout:1/used_bytes": 2**29}
    assert summarize_rollout_admission(result) == {"kv_reserve": "cap", "kv_cache_gib": 3.5, "admitted": 40.0,
                                                   "deferred": 7.0,
                                                   "splits": 3.0, "budget_gib": 3.0, "used_gib": 0.5}


def test_a_streaming_row_stopped_by_its_time_limit_says_so_not_that_it_did_not_fit():
    """A row whose run a signal stopped has no mode in its summary: the error names the
    stop and its steps, not placement (the message a time-limited call once read)."""
    from bench.common import check_row_streamed

    stopped = {"status": "interrupted", "signal": "SIGTERM", "forced": True, "steps": 2}
    with pytest.raises(RuntimeError, match=r"stopped after 2 steps \(SIGTERM, forced\)") as err:
        check_row_streamed("streaming", stopped)
    assert "placement" not in str(err.value)


def test_each_row_is_written_as_it_ends_and_a_later_call_adds_its_rows(tmp_path, monkeypatch):
    """A call stopped by its time limit keeps the rows it finished (``status: partial``),
    and ``--add-to`` joins a later call's rows to them, refusing another job's result.
    The rows and the job are fakes (no launch): what is tested is the bookkeeping."""
    import bench.longtail as lt

    def fake_prepare(model, steps, schedule, root, reward=False, on_gpu=True):
        root.mkdir(parents=True)
        count = steps * load_config(lt.CONFIG).train.prompts_per_step
        return lt.Job(lt.CONFIG, steps, schedule, model, count, root / "prompts.jsonl", ("data.shuffle=false",))

    rates = {"streaming": 30.0, "lockstep": 10.0}
    seen = []

    def fake_row(name, job, root, extra=(), warmup=1):
        seen.append(sorted(p.name for p in (tmp_path / "longtail").glob("*.json")))
        return {"system": f"conveyor-{name}", "status": "ok", "samples_per_s": rates[name]}

    monkeypatch.setattr(lt, "prepare_job", fake_prepare)
    monkeypatch.setattr(lt, "run_conveyor_row", fake_row)
    monkeypatch.setattr(lt, "plot", lambda payload: None)
    first = lt.run(quick=True, out_dir=tmp_path, systems="lockstep,streaming", model="tiny", steps=2)
    doc = json.loads(first["result_path"].read_text())
    # Before the second row ran, the first was already on disk, marked partial.
    assert seen[0] == [] and seen[1] == [first["result_path"].name]
    assert doc["status"] == "ok" and doc["rows_pending"] == [] and list(doc["runs"]) == ["lockstep", "streaming"]
    assert doc["ratios"]["streaming_over_lockstep"] == 3.0

    rates["streaming"] = 33.0
    second = lt.run(quick=True, out_dir=tmp_path / "b", systems="streaming", model="tiny", steps=2,
                    add_to=first["result_path"])
    joined = json.loads(second["result_path"].read_text())
    assert list(joined["runs"]) == ["lockstep", "streaming", "streaming#2"]
    assert joined["params"]["systems"] == ["lockstep", "streaming", "streaming"]
    assert [p["systems"] for p in joined["parts"]] == [["lockstep", "streaming"], ["streaming"]]
    assert joined["ratios"]["streaming_over_lockstep"] == 3.0  # the first row of a kind is the one compared
    # Two calls' results, made elsewhere, joined here without running anything: rows in order,
    # the calls' machine and commit kept, not this machine's and checkout's.
    for path in (first["result_path"], second["result_path"]):
        made = json.loads(path.read_text())
        made["machine"] = {**made["machine"], "hostname": "gpu-host", "gpu": "Some GPU"}
        for part in made.get("parts") or []:
            part["commit"] = "c0ffee" * 6 + "c0ff"
        path.write_text(json.dumps(made))
    joined_twice = lt.join([first["result_path"], second["result_path"]], tmp_path / "d")
    doc = json.loads(joined_twice["result_path"].read_text())
    assert list(doc["runs"]) == ["lockstep", "streaming", "lockstep#2", "streaming#2", "streaming#3"]
    assert doc["provenance"]["commit"] == "c0ffee" * 6 + "c0ff" and len(doc["parts"]) == 3
    assert doc["machine"]["hostname"] == "gpu-host" and joined_twice["result_path"].name.startswith(
        f"{doc['provenance']['utc'][:10]}_c0ffeec_")
    other = tmp_path / "other-gpu.json"
    other.write_text(json.dumps({**json.loads(first["result_path"].read_text()), "machine": {"gpu": None}}))
    with pytest.raises(ValueError, match="differs in gpu: None there, 'Some GPU' here"):
        lt.join([first["result_path"], other], tmp_path / "e")
    with pytest.raises(ValueError, match="--add-to/--join: .* differs in steps: 2 there, 3 here"):
        lt.run(quick=True, out_dir=tmp_path / "c", systems="streaming", model="tiny", steps=3,
               add_to=first["result_path"])


def test_conveyor_rows_generate_with_the_kv_cache_the_first_row_made(tmp_path, monkeypatch):
    """On a GPU every later Conveyor row is given the cache the first finished one's vLLM
    made (its replica's cache, not its admission budget; rounded down), unless it changes the GPU's split or is
    the colocate row; a size given pins the first row too; ``off`` pins none. The rows
    are fakes (no launch): what is tested is what each row is handed."""
    import bench.longtail as lt

    given: list[tuple[str, tuple[str, ...]]] = []

    def fake_row(name, job, root, extra=(), warmup=1):
        given.append((name, tuple(extra)))
        cache = 21.5361 if name == "streaming" and not extra else 15.0
        return {"system": f"conveyor-{name}", "status": "ok", "samples_per_s": 1.0,
                "rollout_admission": [{"kv_cache_gib": cache, "budget_gib": 0.85 * cache}]}

    monkeypatch.setattr(lt, "run_conveyor_row", fake_row)
    job = lt.Job(lt.CONFIG, 2, LengthSchedule(scale=1 / 64), "tiny", 64, tmp_path / "p.jsonl", colocate_kv_gib=3.5)
    specs = (("streaming", ()), ("lockstep", ()), ("streaming", ("train.pass_tokens=8192",)),
             ("colocate", ()), ("streaming", ("rollout.recompute_on_update=false",)))
    rows = lt.run_rows(job, specs, tmp_path, on_gpu=True, warmup=1)
    assert given == [("streaming", ()), ("lockstep", ("rollout.kv_cache_gib=21.53",)),
                     ("streaming", ("train.pass_tokens=8192",)), ("colocate", ("rollout.kv_cache_gib=3.5",)),
                     ("streaming", ("rollout.recompute_on_update=false", "rollout.kv_cache_gib=21.53"))]
    assert rows["lockstep"]["kv_cache_pinned"] == {"gib": 21.53, "from": "streaming"}
    assert "kv_cache_pinned" not in rows["streaming#2"] and rows["streaming#3"]["requested"] == (
        "streaming[rollout.recompute_on_update=false]")  # as --systems gave it

    # An earlier call's row is the first row; a size given pins every row; off pins none.
    given.clear()
    lt.run_rows(job, (("lockstep", ()),), tmp_path, on_gpu=True, warmup=1, rows={"streaming": rows["streaming"]})
    assert given == [("lockstep", ("rollout.kv_cache_gib=21.53",))]
    # A row of a result made before rollouts reported their cache: nothing to pin to.
    given.clear()
    older = {**rows["streaming"], "rollout_admission": [{"budget_gib": 18.3}]}
    lt.run_rows(job, (("lockstep", ()),), tmp_path, on_gpu=True, warmup=1, rows={"streaming": older})
    assert given == [("lockstep", ())]
    given.clear()
    lt.run_rows(job, (("streaming", ()), ("lockstep", ())), tmp_path, on_gpu=True, warmup=1, kv_cache_gib=20.0)
    assert given == [("streaming", ("rollout.kv_cache_gib=20",)), ("lockstep", ("rollout.kv_cache_gib=20",))]
    given.clear()
    lt.run_rows(job, (("streaming", ()), ("lockstep", ())), tmp_path, on_gpu=True, warmup=1, kv_cache_gib="off")
    assert given == [("streaming", ()), ("lockstep", ())]
    # On a CPU the cache is the config's in every row already: nothing to pin.
    given.clear()
    lt.run_rows(job, (("streaming", ()), ("lockstep", ())), tmp_path, on_gpu=False, warmup=1)
    assert given == [("streaming", ()), ("lockstep", ())]


def test_the_kv_cache_flag_takes_first_off_or_a_positive_size():
    from bench.__main__ import main, parse_kv_cache_gib

    assert [parse_kv_cache_gib(t) for t in ("first", "off", "18.3")] == ["first", "off", 18.3]
    for bad in ("0", "-2", "big"):
        with pytest.raises(SystemExit):
            main(["longtail", "--kv-cache-gib", bad])
    with pytest.raises(SystemExit):
        main(["gpu_e2e", "--kv-cache-gib", "18"])  # only longtail takes it


def test_the_scheduler_probe_counts_each_preemption_once_also_after_its_request_left():
    """On a fake scheduler (named as such): KV usage is averaged over the steps observed;
    a request's preemptions count once, whether it is still running or has finished."""
    from types import SimpleNamespace as NS

    from stages.rollout.vllm_inproc import SchedulerProbe

    fake = NS(kv_cache_manager=NS(usage=0.5), requests={"a": NS(num_preemptions=0), "b": NS(num_preemptions=1)},
              running=["a"])
    probe = SchedulerProbe(fake)
    probe.observe()
    probe.before_update_recompute()  # an update's pause preempts the one running request
    fake.kv_cache_manager.usage, fake.requests["a"].num_preemptions = 1.0, 2
    probe.observe()
    assert probe.stats() == {"kv_usage_mean": 0.75, "kv_usage_max": 1.0, "preemptions": 3, "update_recomputes": 1}
    del fake.requests["a"]  # finished: its 2 stay counted, not twice
    fake.kv_cache_manager.usage = 0.0
    probe.observe()
    probe.observe()
    assert probe.stats() == {"kv_usage_mean": 0.375, "kv_usage_max": 1.0, "preemptions": 3, "update_recomputes": 1}
    other = SchedulerProbe(NS(requests={}))  # another vLLM: no kv_cache_manager
    other.observe()
    assert other.stats() == {} and "differs" in other.unavailable
    assert SchedulerProbe.of(NS()).stats() == {}


def test_the_trainers_batches_follow_each_prompts_scheduled_length():
    from bench.trainer_gpu import build_step_batches

    groups = [(5, 10), (7, 40), (6, 3), (9, 200)]  # (prompt tokens, completion tokens) per prompt
    first, second = build_step_batches(4, 2, 3, 100, 50, groups=groups)
    assert first.prompt_lens.tolist() == [5, 5, 5, 7, 7, 7] and first.completion_lens.tolist() == [10] * 3 + [40] * 3
    assert first.completion_ids.shape == (6, 40)  # as wide as its longest, not the cap
    assert second.completion_lens.tolist() == [3] * 3 + [100] * 3  # 200 clamped to max_tokens
    assert second.behaviour_logprobs.shape == second.token_versions.shape == (6, 100)
    assert int((first.completion_ids[:3] != 0).sum(axis=1).max()) <= 10  # nothing past a sample's length
    (whole,) = build_step_batches(4, 4, 3, 100, 50, groups=groups)  # the step as one micro-batch
    assert whole.num_tokens == first.num_tokens + second.num_tokens
    with pytest.raises(ValueError, match="one .* per prompt \\(4\\), got 3"):
        build_step_batches(4, 2, 3, 100, 50, groups=groups[:3])


def test_the_engines_alone_get_each_rows_budget_clamped_as_the_rollout_clamps_it(tmp_path):
    from transformers import AutoTokenizer

    from bench.engine_alone import build_prompt_requests
    from bench.longtail import prepare_job
    from stages.models.tiny import resolve_model_path

    schedule = LengthSchedule(scale=1 / 64)
    job = prepare_job("tiny", 1, schedule, tmp_path, on_gpu=False)
    cap = 20  # below some of the schedule's lengths
    cfg = load_config(job.config, [*job.overrides, f"rollout.max_tokens={cap}"])
    path = resolve_model_path(cfg.model)
    got = build_prompt_requests(cfg, AutoTokenizer.from_pretrained(path), path, job.prompts)
    want = [min(n, cap) for n in schedule.lengths(job.prompts)]
    assert [b for _, b in got] == [(n, n) for n in want] and cap in want and min(want) < cap
    assert all(ids for ids, _ in got)


def test_each_row_names_its_bound_and_its_share_of_the_engines_alone():
    from bench.engine_alone import schedule_engines_row
    from bench.longtail import compute_bounds

    engines = {**schedule_engines_row(
        {"engine_core": "in_process", "by_step": {"tokens_per_s": 8000.0}, "all_at_once": {"tokens_per_s": 20000.0}},
        {"micro_batches": {"tokens_per_s": 15000.0}, "one_per_step": {"tokens_per_s": 45000.0}}), "spec": "engines"}
    rows = {"streaming": {"spec": "streaming", "status": "ok", "busy_share": {"rollout": 0.6, "trainer": 0.99},
                          "rollout_tokens_per_wall_s": 5000.0, "trainer_tokens_per_wall_s": 12000.0,
                          "bound": {"stage": "trainer", "busy_share": 0.99, "why": "the trainer ran at its rate",
                                    "change": ["train.num_ranks"]}},
            "lockstep": {"spec": "lockstep", "status": "ok", "busy_share": {"rollout": 0.95, "trainer": 0.7},
                         "rollout_tokens_per_wall_s": None, "trainer_tokens_per_wall_s": 3000.0},
            "trl": {"spec": "trl", "status": "ok", "samples_per_s": 3.0},
            "engines": engines}
    assert parse_systems("engines[train.pass_tokens=8192]") == (("engines", ("train.pass_tokens=8192",)),)
    got = compute_bounds(rows)
    assert got["streaming_bound"] == {"stage": "trainer", "busy_share": 0.99, "why": "the trainer ran at its rate",
                                      "change": ["train.num_ranks"]}  # the run's own reading, where it has one
    assert got["lockstep_bound"] == {"stage": "rollout", "busy_share": 0.95}
    assert got["streaming_rollout_of_alone"] == 0.25 and got["streaming_trainer_of_alone"] == 0.8
    assert got["lockstep_rollout_of_alone"] is None and got["lockstep_trainer_of_alone"] == 0.2
    assert "trl_bound" not in got  # a peer's stages are not Conveyor's
    assert got["engines_alone"]["trainer_tokens_per_s_one_per_step"] == 45000.0
    assert "engines_alone" not in compute_bounds({k: v for k, v in rows.items() if k != "engines"})
    assert "engines_tail_share" not in compute_ratios(rows, reward=False)


def test_a_rows_overrides_are_checked_against_the_job_it_runs():
    # --reward's streaming rows run at η 2 (REWARD_STREAMING): a slack of 2 fits there, 3 does not.
    from bench.longtail import check_rows
    from pipeline.config import ConfigError

    check_rows((("streaming", ("dataflow.tail_slack=2",)),), reward=True)
    with pytest.raises(ConfigError, match=r"--systems: row streaming\[dataflow.tail_slack=3\]: dataflow.tail_slack"):
        check_rows((("streaming", ("dataflow.tail_slack=3",)),), reward=True)
