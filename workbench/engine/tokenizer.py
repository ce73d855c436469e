"""Tokenizer: a thin wrapper over a Hugging Face tokenizer, loaded from a GGUF
file or a HF model directory.

Loading is lazy (on first use): importing transformers and rebuilding the BPE
tokenizer from GGUF metadata costs several seconds, and benchmarks that feed
random token ids never need it. A GGUF's tokenizer, once rebuilt, is kept on
disk as the JSON files transformers itself writes (tokenizer.json and its
config; no pickle) under PAGEDKV_MODEL_CACHE, keyed by the file and the
transformers version: a new process (a notebook, a test, `kvwb`) reads it back
in ~0.25 s instead of rebuilding it in ~4 s.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from . import model_cache


_LOADED: dict = {}                 # (path, mtime) -> transformers tokenizer, shared in-process
_LOADED_LOCK = threading.Lock()


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer source not found: {path}")
        if path.is_file() and path.suffix != ".gguf":
            raise ValueError(f"tokenizer source must be a .gguf file or a model directory, got {path}")
        self.path = path
        self._hf: Any = None
        self._lock = threading.Lock()  # engine submission is threaded

    @property
    def hf(self) -> Any:
        """The underlying transformers tokenizer (loaded on first access)."""
        if self._hf is None:
            with self._lock:
                if self._hf is None:
                    self._hf = self._load()
        return self._hf

    def _load(self) -> Any:
        # Rebuilding the BPE from GGUF metadata takes 5-15 s; a notebook that builds several
        # engines over one model (a fault run, then the fix) pays it once. The tokenizer is
        # only read after loading, so sharing it between engines is safe.
        key = (str(self.path.resolve()), self.path.stat().st_mtime_ns)
        with _LOADED_LOCK:
            tok = _LOADED.get(key)
            if tok is None:
                from transformers import AutoTokenizer  # slow import; keep it lazy
                if self.path.is_file():
                    tok = _from_gguf(self.path)
                else:
                    tok = AutoTokenizer.from_pretrained(str(self.path))
                _LOADED[key] = tok
            return tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids transformers' `tokenizer(text)["input_ids"]` gives."""
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render messages with the model's chat template and tokenize them."""
        ids = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        return [int(i) for i in ids]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.hf.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Base vocabulary plus added tokens, i.e. every id encode can return."""
        return len(self.hf)

    def __repr__(self) -> str:
        state = "loaded" if self._hf is not None else "not loaded"
        return f"Tokenizer({str(self.path)!r}, {state})"


def gguf_cache_entry(path: Path) -> Path | None:
    """Where the tokenizer rebuilt from this GGUF is kept (model_cache.py): per file and
    transformers version; None with PAGEDKV_MODEL_CACHE=0."""
    from transformers import __version__
    return model_cache.entry(path, "tokenizer", f"transformers {__version__}")


def _from_gguf(path: Path) -> Any:
    from transformers import AutoTokenizer
    at = gguf_cache_entry(path)
    tok = None if at is None else model_cache.read(at, "tokenizer.json", lambda d: AutoTokenizer.from_pretrained(str(d)))
    if tok is None:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if at is not None:
            model_cache.write(at, lambda d: tok.save_pretrained(str(d)))
    return tok
