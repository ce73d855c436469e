"""vLLM's Prometheus /metrics, scraped into rows: KV cache usage, queue, preemptions, prefix hits.

vLLM's OpenAI server serves /metrics in the Prometheus text format. A handful of its
series say how the KV cache is doing; VLLM_METRICS names them, vllm_sample() reads one
scrape into a row of those columns, and MetricsScraper keeps a row per interval_s in a
daemon thread (frame() gives them as a DataFrame).

    with MetricsScraper("http://127.0.0.1:8000") as m:
        ...                                 # vLLM serves requests
        m.frame().plot(x="t", y="kv_cache_usage")

The parser is a small one of our own: the text format is simple, and the scraper must
not pull prometheus_client's parser (or pandas) into every import.
"""
from __future__ import annotations

import http.client
import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections import deque

# our column -> vLLM's sample name (counters carry the _total their exposition adds)
VLLM_METRICS: dict[str, str] = {
    "kv_cache_usage": "vllm:kv_cache_usage_perc",          # a 0..1 fraction, despite "perc"
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_queries": "vllm:prefix_cache_queries_total",   # prompt tokens looked up
    "prefix_hits": "vllm:prefix_cache_hits_total",         # prompt tokens found cached
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
}
# Columns averaged over vLLM's label sets (one per engine) rather than summed: two
# engines at 0.5 each are a cache half full, not one full.
_MEAN_COLUMNS = frozenset({"kv_cache_usage"})
COLUMNS = ("t", *VLLM_METRICS)
MAX_ERRORS = 100

Labels = dict[str, str]


class MetricsFormatError(ValueError):
    """A line that is not Prometheus text format."""


# ---- parsing -------------------------------------------------------------------------
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_NUMBER = re.compile(r"[+-]?(?:inf|infinity|nan|(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)", re.IGNORECASE)
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _parse_labels(line: str, pos: int, fail) -> tuple[Labels, int]:
    """line[pos] is '{': the labels and the position after the closing '}'."""
    labels: Labels = {}
    pos += 1
    while True:
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if pos < len(line) and line[pos] == "}":
            return labels, pos + 1
        m = _LABEL_NAME.match(line, pos)
        if not m:
            fail(f"expected a label name at column {pos + 1}")
        name, pos = m.group(), m.end()
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if line[pos:pos + 2] != '="':
            fail(f'expected ="..." after label {name!r}')
        pos += 2
        out = []
        while True:
            if pos >= len(line):
                fail(f"label {name!r}: value has no closing quote")
            ch = line[pos]
            if ch == '"':
                pos += 1
                break
            if ch == "\\" and pos + 1 < len(line):
                nxt = line[pos + 1]
                out.append(_ESCAPES.get(nxt, "\\" + nxt))    # unknown escapes kept as written
                pos += 2
                continue
            out.append(ch)
            pos += 1
        if name in labels:
            fail(f"label {name!r} given twice")
        labels[name] = "".join(out)
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if pos < len(line) and line[pos] == ",":
            pos += 1                # a trailing comma before '}' is allowed
        elif not (pos < len(line) and line[pos] == "}"):
            fail(f"expected ',' or '}}' after label {name!r}")


def parse_prometheus(text: str) -> dict[str, list[tuple[Labels, float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}.

    Comments (HELP, TYPE, # EOF) are skipped; timestamps are read and dropped; +Inf, -Inf
    and NaN are floats. Histogram and counter samples keep their suffixed names
    (x_bucket, x_sum, x_count, x_total, x_created). A malformed line raises
    MetricsFormatError naming its line number and text."""
    out: dict[str, list[tuple[Labels, float]]] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue

        def fail(why: str, n=n, raw=raw):
            raise MetricsFormatError(f"line {n}: {why}: {raw[:200]!r}")

        m = _NAME.match(line)
        if not m:
            fail("expected a metric name")
        name, pos = m.group(), m.end()
        labels: Labels = {}
        if pos < len(line) and line[pos] == "{":
            labels, pos = _parse_labels(line, pos, fail)
        elif pos < len(line) and line[pos] not in " \t":
            fail(f"unexpected {line[pos]!r} after the name {name!r}")
        parts = line[pos:].split()
        if not 1 <= len(parts) <= 2:
            fail("expected a value and an optional timestamp after the name and labels")
        if not _NUMBER.fullmatch(parts[0]):
            fail(f"value {parts[0]!r} is not a number")
        if len(parts) == 2 and not _NUMBER.fullmatch(parts[1]):
            fail(f"timestamp {parts[1]!r} is not a number")
        out.setdefault(name, []).append((labels, float(parts[0])))
    return out


def vllm_sample(text: str) -> dict[str, float | None]:
    """One scrape of vLLM's /metrics -> {column: value} for VLLM_METRICS (None where absent).

    Each series has one label set per engine (model_name, engine); counts are summed over
    them, the kv_cache_usage fraction is averaged. NaN samples are left out."""
    samples = parse_prometheus(text)
    row: dict[str, float | None] = {}
    for col, name in VLLM_METRICS.items():
        vals = [v for _, v in samples.get(name, ()) if not math.isnan(v)]
        if not vals:
            row[col] = None
        else:
            row[col] = sum(vals) / len(vals) if col in _MEAN_COLUMNS else sum(vals)
    return row


# ---- scraping ------------------------------------------------------------------------
# No proxies: a notebook's http_proxy would otherwise send 127.0.0.1 through the proxy.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MetricsScraper:
    """Scrapes url + "/metrics" every interval_s in a daemon thread, keeping a row per scrape.

    rows: [{"t": time.time(), <VLLM_METRICS columns>}], bounded by max_rows. A failed
    scrape (server down, wrong URL, bad text) keeps the rows and records its message in
    `errors` once per run of identical failures, not once per interval."""

    def __init__(self, url: str = "http://127.0.0.1:8000", interval_s: float = 1.0,
                 timeout_s: float = 2.0, max_rows: int = 100_000, on_row=None):
        base = url.rstrip("/")
        self.url = base[: -len("/metrics")] if base.endswith("/metrics") else base
        self.metrics_url = self.url + "/metrics"
        self.interval_s, self.timeout_s = float(interval_s), float(timeout_s)
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError(f"interval_s={interval_s!r} and timeout_s={timeout_s!r} must be > 0")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url={url!r}: expected http://HOST:PORT (vLLM's server)")
        self._lock = threading.Lock()
        self._rows: deque[dict] = deque(maxlen=max_rows)
        self._errors: deque[str] = deque(maxlen=MAX_ERRORS)
        self._failing: str | None = None       # the message of the failure streak going on, if any
        self.last_ok: float | None = None      # time.time() of the last good scrape
        self.scrapes = 0
        self.failures = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self.on_row = on_row                   # on_row(index, row) after each good scrape, on its thread

    @property
    def failing(self) -> str | None:
        """The failure going on now (None once a scrape succeeds again)."""
        with self._lock:
            return self._failing

    # -- one scrape
    def scrape_once(self) -> dict | None:
        """Scrape now: the row appended, or None (the reason is in `errors`). Never raises."""
        try:
            text = self._fetch()
            row = {"t": time.time(), **vllm_sample(text)}
        except _ScrapeFailed as e:
            self._fail(str(e))
            return None
        except MetricsFormatError as e:
            self._fail(f"{self.metrics_url}: {e}")
            return None
        except Exception as e:     # anything else is a bug here; report it like a failure
            self._fail(f"{self.metrics_url}: {type(e).__name__}: {e}")
            return None
        if all(row[c] is None for c in VLLM_METRICS):
            self._fail(f"{self.metrics_url} serves no vllm:* metrics (is it vLLM's server?)")
            return None
        with self._lock:
            self._rows.append(row)
            index = self.scrapes
            self.scrapes += 1
            self.last_ok = row["t"]
            self._failing = None
        if self.on_row is not None:
            try:
                self.on_row(index, row)
            except Exception as e:             # a consumer's bug is reported, the scraping goes on
                self._fail(f"on_row: {type(e).__name__}: {e}")
        return row

    def _fetch(self) -> str:
        url = self.metrics_url
        try:
            with _OPENER.open(url, timeout=self.timeout_s) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            raise _ScrapeFailed(f"{url} answered HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, TimeoutError):
                raise _ScrapeFailed(f"{url} did not answer within {self.timeout_s:g} s") from None
            why = reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)
            raise _ScrapeFailed(f"cannot reach {url}: {why}") from None
        except TimeoutError:
            raise _ScrapeFailed(f"{url} did not answer within {self.timeout_s:g} s") from None
        except OSError as e:             # the server went away mid-answer (reset, broken pipe)
            raise _ScrapeFailed(f"cannot reach {url}: {e.strerror or e}") from None
        except http.client.HTTPException as e:
            raise _ScrapeFailed(f"cannot read {url}: {type(e).__name__}: {e}") from None
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _ScrapeFailed(f"{url}: the body is not UTF-8 text ({e})") from None

    def _fail(self, msg: str) -> None:
        with self._lock:
            self.failures += 1
            if msg != self._failing:
                self._errors.append(msg)
                self._failing = msg

    # -- reading (copies, under the lock)
    @property
    def rows(self) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._rows]

    @property
    def errors(self) -> list[str]:
        with self._lock:
            return list(self._errors)

    def frame(self):
        """The rows as a pandas DataFrame, columns COLUMNS (t in seconds since the epoch)."""
        import pandas as pd
        return pd.DataFrame(self.rows, columns=list(COLUMNS))

    # -- lifecycle
    def start(self) -> "MetricsScraper":
        if self._closed:
            raise RuntimeError("MetricsScraper is closed; make a new one")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vllm-metrics", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                self.scrape_once()
            except Exception as e:      # scrape_once does not raise; this is the last guard
                self._fail(f"metrics scraper: {type(e).__name__}: {e}")
            if self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0))):
                return

    def close(self) -> None:
        """Stop the thread; safe to call twice, or before start()."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 2.0)

    def __enter__(self) -> "MetricsScraper":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        with self._lock:
            n, err = len(self._rows), self._failing
        return f"<MetricsScraper {self.metrics_url} rows={n}" + (f" failing: {err}>" if err else ">")


class _ScrapeFailed(Exception):
    """A scrape that failed for a reason already put into words."""
