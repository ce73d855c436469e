"""A clean run of 200 production requests with every probe on must stay silent.

The first 200 requests of the Azure LLM code trace (their arrival order and lengths,
prompt and output lengths scaled to fit a 2-core CPU) through SmolLM2.
"""
from pathlib import Path

import pytest

import probes
from workbench import Engine, EngineConfig, Workbench
from workbench.trace import read_trace, replay_full

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv"


@pytest.mark.skipif(not AZURE.exists(), reason="../shared/traces not present")
def test_clean_trace_run_has_no_findings(smollm2_path):
    engine = Engine.from_pretrained(smollm2_path, EngineConfig(num_pages=1024, max_num_seqs=32,
                                                               max_num_batched_tokens=1024))
    wb = Workbench(engine).attach()
    assert sorted(wb.probes) == sorted(probes.PROBES), "every probe must attach"
    trace = read_trace(AZURE)[:200]
    res = replay_full(trace, engine, time_scale=0.05, length_scale=1 / 48, max_output_len=6, workbench=wb)
    assert len(res.requests) == 200 and not res.rejected
    assert (res.requests["output_len"] >= 1).all()
    loud = wb.findings[wb.findings["severity"].isin(["warn", "error", "critical"])]
    assert loud.empty, loud[["probe", "kind", "severity", "step", "message"]].to_string()
    # every probe saw the run (cu_seqlens keeps rows for violations only: count its checks)
    assert wb.probe("cu_seqlens").batches_checked == int((res.steps.num_tokens > 0).sum())
    for name, p in wb.probes.items():
        quiet = ("lock_contention", "cu_seqlens") + (("prefix_cache",) if not engine.stats()["prefix_cache_hits"] else ())
        quiet += ("rank_consistency",) if engine.parallel is None else ()     # one device: no ranks to compare
        assert not p.frame().empty or name in quiet, f"probe {name} recorded nothing"
    wb.detach()
    wb.log.detach()
    assert engine.pool.observer is None and engine.model.hooks is None


def _mooncake_slices():
    from workbench.data import mooncake_excerpt, mooncake_full
    out = [pytest.param(mooncake_excerpt(), 0, id="bundled-excerpt")]
    full = mooncake_full()
    out.append(pytest.param(full, 6000, id="shared-mooncake",
                            marks=pytest.mark.skipif(full is None, reason="../shared/traces not present")))
    return out


@pytest.mark.parametrize("path,start", _mooncake_slices())
def test_clean_conversation_replay_with_prefix_hits_is_silent(smollm2_path, path, start):
    # Conversation turns share prefix blocks: the prefix-cache, packing and pool-accounting
    # checks all run on real hits (512-token blocks scaled to one 16-token page each).
    engine = Engine.from_pretrained(smollm2_path, EngineConfig(num_pages=512, max_num_seqs=16,
                                                               max_num_batched_tokens=512))
    wb = Workbench(engine).attach()
    trace = read_trace(path)[start:start + 40]
    res = replay_full(trace, engine, time_scale=0.02, length_scale=1 / 32, max_prompt_len=256,
                      max_output_len=4, workbench=wb)
    assert len(res.requests) == 40 and not res.rejected
    assert engine.stats()["prefix_cache_hits"] > 0 and wb.probe("prefix_cache").hits_checked > 0
    assert wb.probe("pool_accounting").checks > 0 and engine.pool.num_used == 0
    loud = wb.findings[wb.findings["severity"].isin(["warn", "error", "critical"])]
    assert loud.empty, loud[["probe", "kind", "severity", "step", "message"]].to_string()
    wb.detach()
    wb.log.detach()
