"""vLLM's /metrics, parsed and scraped over real HTTP on 127.0.0.1 (no vLLM needed).

VLLM_TEXT is what vLLM 0.32's server exposes (prometheus_client's exposition: HELP and
TYPE lines, model_name/engine labels, counters as _total plus _created, histograms as
_bucket{le=...}/_sum/_count), trimmed, for two engines of one model."""
import math
import threading
import time

import pytest

from workbench.adapters.vllm.metrics import (COLUMNS, VLLM_METRICS, MetricsFormatError, MetricsScraper,
                                             parse_prometheus, vllm_sample)

from vllm_fakes import MetricsServer, free_port, wait_until

pytestmark = pytest.mark.timeout(60)

VLLM_TEXT = r'''# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12013.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 1.0
vllm:num_requests_waiting{engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct",reason="capacity"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 4096.0
vllm:prefix_cache_queries_total{engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 1024.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 1.7512345678901e+09
vllm:prefix_cache_queries_created{engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 1.7512345678901e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 2048.0
vllm:prefix_cache_hits_total{engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 0.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 7.0
vllm:num_preemptions_total{engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 5120.0
vllm:prompt_tokens_total{engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 1000.0
vllm:prompt_tokens_created{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 1.7512345678901e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 777.0
vllm:generation_tokens_total{engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 223.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 0.123
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""} 1.7512345e+09
# a hand-written comment, then escapes, a trailing comma, NaN, -Inf and a timestamp
test_escapes{path="C:\\models\\x",quote="say \"hi\"",nl="a\nb",} NaN 1751234567890
test_neg_inf -Inf
'''


@pytest.fixture
def server():
    s = MetricsServer(VLLM_TEXT)
    yield s
    s.stop()



# ---- parsing -------------------------------------------------------------------------
def test_parse_prometheus():
    m = parse_prometheus(VLLM_TEXT)
    assert m["vllm:num_requests_running"] == [
        ({"engine": "0", "model_name": "HuggingFaceTB/SmolLM2-135M-Instruct"}, 3.0),
        ({"engine": "1", "model_name": "HuggingFaceTB/SmolLM2-135M-Instruct"}, 2.0)]
    buckets = m["vllm:time_to_first_token_seconds_bucket"]
    assert [(lab["le"], v) for lab, v in buckets] == [("0.001", 0.0), ("0.005", 2.0), ("+Inf", 9.0)]
    assert m["vllm:prefix_cache_queries_created"][0][1] == pytest.approx(1.7512345678901e9)
    assert m["vllm:lora_requests_info"][0][0]["running_lora_adapters"] == ""
    (labels, v), = m["test_escapes"]
    assert labels == {"path": "C:\\models\\x", "quote": 'say "hi"', "nl": "a\nb"} and math.isnan(v)
    assert m["test_neg_inf"] == [({}, -math.inf)]
    assert not any(name.startswith("#") or name in ("HELP", "TYPE") for name in m)


def test_parse_agrees_with_prometheus_client():
    """Every sample, label and value as prometheus_client's own parser reads them."""
    parser = pytest.importorskip("prometheus_client.parser")
    ours = {(name, tuple(sorted(lab.items())), repr(v)) for name, rows in parse_prometheus(VLLM_TEXT).items()
            for lab, v in rows}
    theirs = {(s.name, tuple(sorted(s.labels.items())), repr(s.value))
              for fam in parser.text_string_to_metric_families(VLLM_TEXT) for s in fam.samples}
    assert ours == theirs


def test_malformed_line_names_its_number():
    bad = [("vllm:x{engine=\"0\"} twelve", "value 'twelve' is not a number"),
           ("vllm:x{engine=\"0} 1", "no closing quote"),
           ("vllm:x{engine 0} 1", 'expected ="..."'),
           ("vllm:x{a=\"1\" b=\"2\"} 1", "expected ',' or '}'"),
           ("vllm:x", "expected a value"),
           ("vllm:x 1 2 3", "expected a value"),
           ("vllm-x 1", "unexpected '-'"),
           ("{a=\"1\"} 1", "expected a metric name")]
    for line, words in bad:
        text = "# HELP vllm:x X.\n# TYPE vllm:x gauge\nvllm:ok 1\n" + line + "\n"
        with pytest.raises(MetricsFormatError) as e:
            parse_prometheus(text)
        assert str(e.value).startswith("line 4: ") and words in str(e.value) and repr(line) in str(e.value), str(e.value)


def test_vllm_sample():
    row = vllm_sample(VLLM_TEXT)
    assert row == {"kv_cache_usage": 0.5,       # averaged over the two engines: half full
                   "running": 5.0, "waiting": 1.0, "preemptions": 8.0, "prefix_queries": 5120.0,
                   "prefix_hits": 2048.0, "prompt_tokens": 6120.0, "generation_tokens": 1000.0}
    assert list(row) == list(VLLM_METRICS)
    only_running = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 4\n"
    row = vllm_sample(only_running)
    assert row["running"] == 4.0 and all(row[c] is None for c in VLLM_METRICS if c != "running")


# ---- scraping ------------------------------------------------------------------------
def test_scrape_once_and_frame(server):
    m = MetricsScraper(server.url + "/")        # a trailing slash, or /metrics, is the same server
    assert m.metrics_url == server.url + "/metrics"
    assert MetricsScraper(server.url + "/metrics").metrics_url == m.metrics_url
    t0 = time.time()
    row = m.scrape_once()
    assert row["running"] == 5.0 and t0 <= row["t"] <= time.time() and m.last_ok == row["t"]
    server.text = VLLM_TEXT.replace('engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 2.0',
                                    'engine="1",model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 9.0')
    assert m.scrape_once()["running"] == 12.0
    df = m.frame()
    assert list(df.columns) == list(COLUMNS) and len(df) == 2
    assert df["running"].tolist() == [5.0, 12.0] and df["kv_cache_usage"].tolist() == [0.5, 0.5]
    assert m.errors == []


def test_wrong_url_gives_one_clear_error():
    url = f"http://127.0.0.1:{free_port()}"    # nothing listens there
    with MetricsScraper(url, interval_s=0.02, timeout_s=0.5) as m:
        assert wait_until(lambda: m.failures >= 5)
    assert m.errors == [f"cannot reach {url}/metrics: Connection refused"]
    assert m.rows == [] and m.last_ok is None and m.scrape_once() is None
    assert m.frame().empty


def test_server_that_disappears_keeps_the_last_good_rows(server):
    with MetricsScraper(server.url, interval_s=0.02, timeout_s=0.5) as m:
        assert wait_until(lambda: len(m.rows) >= 3)
        server.stop()
        n_before = m.scrapes
        failures = m.failures
        assert wait_until(lambda: m.failures >= failures + 5)
        rows, last_ok = m.rows, m.last_ok
        assert len(rows) >= n_before and rows[-1]["running"] == 5.0 and last_ok == rows[-1]["t"]
        # one message per kind of failure, not one per scrape (a scrape cut off as the server
        # went may add "Connection reset by peer" before the refusals)
        errors = m.errors
        assert errors[-1] == f"cannot reach {server.url}/metrics: Connection refused" and len(errors) <= 2
    assert not m._thread.is_alive()
    m.close()                                   # twice is fine
    assert not any(t.name == "vllm-metrics" for t in threading.enumerate())


def test_bad_answers_are_errors_not_exceptions(server):
    m = MetricsScraper(server.url, timeout_s=0.5)
    server.text = "vllm:num_requests_running{engine=\"0\"} 1\nvllm:broken{ 1\n"
    assert m.scrape_once() is None
    assert m.errors[-1].startswith(f"{server.url}/metrics: line 2: ")
    server.text = "# TYPE go_goroutines gauge\ngo_goroutines 12\n"
    assert m.scrape_once() is None
    assert m.errors[-1] == f"{server.url}/metrics serves no vllm:* metrics (is it vLLM's server?)"
    m404 = MetricsScraper(server.url + "/v1", timeout_s=0.5)
    assert m404.scrape_once() is None
    assert m404.errors == [f"{server.url}/v1/metrics answered HTTP 404 Not Found"]
    server.text = VLLM_TEXT
    assert m.scrape_once() is not None and len(m.errors) == 2
