"""The PAGEDKV_* variables (workbench/engine/env.py): one table, each row an EngineConfig field (or a
process-wide path), one reader; the fields work without any variable, the variables only override."""
import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

import workbench
from workbench import Engine, EngineConfig
from workbench.engine import env, pool_ops
from workbench.engine.attention import TorchPagedAttention
from workbench.engine.config import ConfigError
from workbench.engine.sequence import SamplingParams

ROOT = Path(workbench.__file__).parent
FIELD_ROWS = [v for v in env.TABLE if v.field]
CHOICE_ROWS = [v for v in env.TABLE if v.values]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = [[1, 17, 99, 3, 45, 200, 8], [1, 5, 5, 130, 77]]


def _sample(var: env.Var) -> str:
    """A value of var other than its default."""
    if var.number:
        return "7.5"
    if var.values is None:
        return "cpu"
    return next(v for v in var.values if v != var.fallback)


@pytest.fixture
def clean_env(monkeypatch):
    for var in env.TABLE:
        if var.name not in ("PAGEDKV_EXTENSIONS_DIR", "PAGEDKV_CACHE_DIR"):
            monkeypatch.delenv(var.name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("var", FIELD_ROWS, ids=lambda v: v.name)
def test_each_variable_overrides_its_field(var):
    assert var.field in EngineConfig.__dataclass_fields__ and var.meaning
    want = float(_sample(var)) if var.number else _sample(var)
    assert env.overrides({var.name: _sample(var)}) == {var.field: want}
    cfg, applied = env.apply(EngineConfig(), {var.name: _sample(var)})
    assert getattr(cfg, var.field) == want and applied == {var.field: f"{var.name}={want}"}
    assert env.value(var.name, {}) == getattr(EngineConfig(), var.field)         # unset: the field's default
    assert env.apply(EngineConfig(), {var.name: ""}) == (EngineConfig(), {})     # empty: unset


@pytest.mark.parametrize("var", CHOICE_ROWS, ids=lambda v: v.name)
def test_a_bad_value_names_the_variable_and_what_it_takes(var):
    with pytest.raises(ConfigError, match=f"{var.name}='bogus': expected one of {', '.join(var.values)}"):
        env.overrides({var.name: "bogus"}) if var.field else env.value(var.name, {var.name: "bogus"})
    if var.field and "npu" not in var.values:        # every value the variable takes, the field takes
        for v in var.values:
            EngineConfig(**{var.field: v})


@pytest.mark.parametrize("name", ["PAGEDKV_TP_TIMEOUT_S", "PAGEDKV_TP_STARTUP_S"])
def test_seconds_must_be_positive(name):
    for bad in ("0", "-3", "soon"):
        with pytest.raises(ConfigError, match=f"{name}='{bad}': expected a positive number of seconds"):
            env.overrides({name: bad})


def test_fields_are_validated():
    for field, bad in (("pool_ops", "c"), ("linear_backend", "onednn"), ("bf16_mode", "fast"),
                       ("hugepages", "on"), ("quant_layout", "q4"), ("tp_allreduce", "nccl")):
        with pytest.raises(ConfigError, match=f"{field}='{bad}' is not one of"):
            EngineConfig(**{field: bad})
    with pytest.raises(ConfigError, match="tp_timeout_s must be a positive number"):
        EngineConfig(tp_timeout_s=0)


def test_an_explicit_device_is_never_overridden():
    assert env.apply(EngineConfig(device="cpu"), {"PAGEDKV_DEVICE": "cuda"})[0].device == "cpu"
    assert env.apply(EngineConfig(), {"PAGEDKV_DEVICE": "cpu"})[0].device == "cpu"


def test_the_docs_table_lists_every_variable():
    readme = (ROOT.parent / "docs" / "reference" / "environment.md").read_text()
    rows = dict(re.findall(r"^\| `(PAGEDKV_[A-Z0-9_]+)` \| ([^|]+) \|", readme, re.M))
    assert set(rows) == {v.name for v in env.TABLE}
    for var in env.TABLE:
        assert (f"`{var.field}`" if var.field else "process-wide") in rows[var.name], var.name


def _pagedkv_names(tree) -> set[str]:
    """Module-level names bound to a "PAGEDKV_..." string."""
    return {t.id for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and str(node.value.value).startswith("PAGEDKV_") for t in node.targets if isinstance(t, ast.Name)}


def _reads_environ(node) -> list:
    """The arguments of os.environ.get / os.getenv / os.environ[...] / `in os.environ` in node."""
    is_environ = lambda n: isinstance(n, ast.Attribute) and n.attr == "environ"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
            (node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value))
            or node.func.attr == "getenv"):
        return [node.args[0]]
    if isinstance(node, ast.Subscript) and is_environ(node.value):
        return [node.slice]
    if isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
        return [node.left]
    return []


def test_only_env_py_reads_pagedkv_variables():
    offenders = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if path == ROOT / "engine" / "env.py":
            continue
        tree = ast.parse(path.read_text())
        names = _pagedkv_names(tree)
        for node in ast.walk(tree):
            for arg in _reads_environ(node):
                if (isinstance(arg, ast.Constant) and str(arg.value).startswith("PAGEDKV_")) or (
                        isinstance(arg, ast.Name) and arg.id in names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Constant) and re.fullmatch(r"PAGEDKV_[A-Z0-9_]+", str(node.value)):
                assert node.value in env.BY_NAME, f"{path}: {node.value} is not in env.TABLE"
    assert offenders == []


# --- engines: the fields without any variable, and a variable as an override -------------------------------
@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, enable_prefix_caching=False))
    return [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]


def test_explicit_fields_choose_the_torch_and_python_paths(tiny_llama_dir, reference, clean_env):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(
        num_pages=64, enable_prefix_caching=False, pool_ops="python", linear_backend="torch",
        attention_backend="torch"))
    ks = eng.kernels
    assert eng.env_overrides == {} and ks.overrides == ""
    assert eng.pool._ops.name == eng.scheduler._ops.name == ks.pool_ops == "python"
    assert ks.pool_ops_why == "pool_ops='python'"
    assert eng.model.linear_backend == ks.linear == "torch" and "linear_backend='torch'" in ks.linear_why
    assert type(eng.attn) is TorchPagedAttention and ks.attention == "torch"
    # this engine's own choices name no variable (the refused / confirmed rows are the process's trials: on a
    # faked CPU a refusal rightly names PAGEDKV_CPU_FEATURES)
    assert "PAGEDKV" not in str(dataclasses.replace(ks, refused=(), confirmed=()))
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == reference
    if pool_ops.compiled() is not None:           # the process keeps its build: only this engine left it
        assert pool_ops.active().name == "compiled"


def test_bf16_mode_field_sets_the_compute_dtype(tiny_llama_dir, clean_env):
    for mode, dtype in (("storage", torch.float32), ("native", torch.bfloat16)):
        eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, dtype="bfloat16", bf16_mode=mode))
        assert eng.model.dtype == dtype and eng.kernels.bf16 == mode and f"bf16_mode='{mode}'" in eng.kernels.bf16_why


def test_a_variable_overrides_the_engine_config_and_says_so(tiny_llama_dir, reference, clean_env, caplog):
    clean_env.setenv("PAGEDKV_POOL", "python")
    clean_env.setenv("PAGEDKV_HUGEPAGES", "off")
    with caplog.at_level("INFO", logger="workbench.engine"):
        eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, enable_prefix_caching=False))
    assert eng.config.pool_ops == "python" and eng.config.hugepages == "off"
    assert eng.env_overrides == {"pool_ops": "PAGEDKV_POOL=python", "hugepages": "PAGEDKV_HUGEPAGES=off"}
    assert eng.pool._ops.name == "python" and "PAGEDKV_POOL=python" in eng.kernels.pool_ops_why
    assert eng.kernels.overrides == "PAGEDKV_POOL=python, PAGEDKV_HUGEPAGES=off"
    assert ("env", eng.kernels.overrides) in eng.kernels.rows()
    assert sum("environment overrides: PAGEDKV_POOL=python" in r.message for r in caplog.records) == 1
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == reference
    clean_env.setenv("PAGEDKV_POOL", "c")
    with pytest.raises(ConfigError, match="PAGEDKV_POOL='c': expected one of auto, python"):
        Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))
