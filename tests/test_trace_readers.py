"""Trace readers on the real production traces in ../shared/traces, and on broken input."""
import json
from pathlib import Path

import pytest

from workbench.trace import TraceFormatError, prompt_tokens, read_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_fast25_conversation" / "conversation_trace.jsonl"
AZURE = TRACES / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv"
needs_traces = pytest.mark.skipif(not MOONCAKE.exists(), reason="../shared/traces not present")


@needs_traces
def test_mooncake_rows_lengths_and_sharing():
    t = read_trace(MOONCAKE)
    raw = [json.loads(l) for l in MOONCAKE.read_text().splitlines()]
    assert t.format == "mooncake" and len(t) == len(raw) == 12031
    assert [r.prompt_len for r in t] == [o["input_length"] for o in raw]
    assert [r.output_len for r in t] == [o["output_length"] for o in raw]
    assert t[-1].arrival_s == raw[-1]["timestamp"] / 1000
    # synthesised prompts: equal hash ids give equal token blocks, other ids other blocks
    a, b = t[0], t[1]
    assert a.hash_ids[0] == b.hash_ids[0] and a.hash_ids[1] != b.hash_ids[1]
    pa, pb = prompt_tokens(a, 0, 49152), prompt_tokens(b, 1, 49152)
    assert len(pa) == a.prompt_len and pa[:512] == pb[:512] and pa[512:1024] != pb[512:1024]


@needs_traces
def test_azure_rows_and_lengths():
    t = read_trace(AZURE)
    lines = AZURE.read_text().splitlines()[1:]
    assert t.format == "azure" and len(t) == len(lines) == 8819
    first = lines[0].split(",")
    assert t[0].prompt_len == int(first[1]) and t[0].output_len == int(first[2]) and t[0].arrival_s == 0
    assert all(t[i].arrival_s <= t[i + 1].arrival_s for i in range(len(t) - 1))


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("name, text, match", [
    ("bad.jsonl", '{"arrival_s": 0, "output_len": 3, "prompt_len": 4}\n{oops}\n{"arrival_s": 1}\n', r"bad.jsonl:2: not valid JSON"),
    ("missing.jsonl", '{"arrival_s": 0, "output_len": 3}\n', r"missing.jsonl:1: missing field 'prompt_len"),
    ("neg.jsonl", '{"arrival_s": 0, "output_len": -3, "prompt_len": 4}\n', r"neg.jsonl:1: field 'output_len' is negative"),
    ("order.jsonl", '{"arrival_s": 5, "output_len": 3, "prompt_len": 4}\n{"arrival_s": 1, "output_len": 3, "prompt_len": 4}\n',
     r"order.jsonl:2: timestamps go back in time"),
    ("empty.jsonl", "", r"empty.jsonl: the file is empty"),
    ("other.txt", "hello world\nthis is not a trace\n", r"other.txt:1: unrecognised trace format"),
    ("azure.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,48,10\n2023-11-16 18:17:04.03,x,8\n",
     r"azure.csv:3: field 'ContextTokens' is 'x', not a number"),
    ("moon.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}\n',
     r"moon.jsonl:1: 1 hash_ids for input_length 600"),
])
def test_malformed_input_names_file_and_line(tmp_path, name, text, match):
    with pytest.raises(TraceFormatError, match=match):
        read_trace(write(tmp_path, name, text))


def test_explicit_format_checks_the_header(tmp_path):
    with pytest.raises(TraceFormatError, match=r"cols.csv:1: header .* lacks column"):
        read_trace(write(tmp_path, "cols.csv", "TIMESTAMP,Context\n1,2\n"), format="azure")


def test_torn_last_line_is_skipped_and_counted(tmp_path):
    p = write(tmp_path, "cap.jsonl", '{"arrival_s": 0, "output_len": 3, "prompt_len": 4}\n{"arrival_s": 1, "outp')
    t = read_trace(p)
    assert len(t) == 1 and t.skipped == {"torn_last_line": 1}


def test_burstgpt_skips_failed_requests(tmp_path):
    p = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
              "5,ChatGPT,100,20,120,Conversation log\n6,GPT-4,50,0,50,Conversation log\n7.5,ChatGPT,30,9,39,API log\n")
    t = read_trace(p)
    assert t.format == "burstgpt" and len(t) == 2 and t.skipped == {"failed_requests": 1}
    assert [r.arrival_s for r in t] == [0, 2.5] and [r.prompt_len for r in t] == [100, 30]


def test_native_jsonl_and_parquet_round_trip(tmp_path):
    import pandas as pd
    recs = [{"id": "a", "arrival_s": 0.0, "output_len": 3, "prompt_token_ids": [5, 6, 7]},
            {"id": "b", "arrival_s": 0.5, "output_len": 4, "prompt_len": 10, "hash_ids": [1], "hash_block_size": 16}]
    p = write(tmp_path, "t.jsonl", "".join(json.dumps(r) + "\n" for r in recs))
    t = read_trace(p)
    assert [r.to_dict() for r in t] == [
        {"id": "a", "arrival_s": 0.0, "output_len": 3, "prompt_len": 3, "prompt_token_ids": [5, 6, 7]},
        {"id": "b", "arrival_s": 0.5, "output_len": 4, "prompt_len": 10, "hash_ids": [1], "hash_block_size": 16}]
    pq = tmp_path / "t.parquet"
    pd.DataFrame([r.to_dict() for r in t]).to_parquet(pq)
    t2 = read_trace(pq)
    assert t2.format == "parquet" and [r.to_dict() for r in t2] == [r.to_dict() for r in t]
