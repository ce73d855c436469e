"""What the vLLM plugin's hooks rely on, read from the pinned vLLM's and vllm-ascend's source.

The plugin (workbench/adapters/vllm/hooks.py) wraps vLLM's methods by name and reads attributes
by name. Against another vLLM a hook whose target is gone is skipped with a status line, and an
attribute read that fails is one logged error: in production the check just goes quiet. These
tests make an upgrade fail loudly in CI instead: each names the file, class and method, and what
it expected against what it found.

The source is parsed with `ast`, never imported: the test environment has no vLLM (it lives in
.venv-vllm, `make vllm`), and vllm-ascend cannot be installed without CANN and torch_npu, so
`make vllm` unpacks its pinned sdist under .cache/vllm-ascend/ (Makefile: VLLM_ASCEND_SDIST_URL).
"""
from __future__ import annotations

import ast
import functools
import re
import subprocess
import warnings
from pathlib import Path

import pytest

from workbench.adapters.vllm.server import ROOT, vllm_python


# ---- reading the source --------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _cls(root: Path, rel: str, name: str) -> ast.ClassDef:
    for n in ast.walk(_tree(root / rel)):
        if isinstance(n, ast.ClassDef) and n.name == name:
            return n
    pytest.fail(f"{rel}: class {name} not found")


def _fn(root: Path, rel: str, cls: str | None, name: str, params: list[str] = ()) -> ast.FunctionDef:
    """The function `name` defined in class `cls` (None: at module level), its first parameters checked."""
    scope = _tree(root / rel) if cls is None else _cls(root, rel, cls)
    where = f"{rel}: {cls + '.' if cls else ''}{name}"
    fn = next((n for n in scope.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
              None)
    assert fn is not None, f"{where}: not defined there any more"
    got = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    assert got[:len(params)] == list(params), f"{where}: expected parameters {list(params)} first, found {got}"
    return fn


def _members(cls: ast.ClassDef) -> set[str]:
    """What a class defines: fields, methods, properties, and `self.X = ...` in its methods."""
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for n in ast.walk(cls):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Name) and n in cls.body:
                names.add(t.id)
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def _calls(node: ast.AST, end: str = "") -> list[ast.Call]:
    """Calls in `node` whose callee, as written (`self.scheduler.schedule`), ends in `end`."""
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and ast.unparse(c.func).endswith(end)]


def _kw(c: ast.Call, name: str) -> bool:
    return any(k.arg == name for k in c.keywords)


def _passes_metadata(c: ast.Call) -> bool:
    # what hooks.py's `build` wrapper reads: keyword common_attn_metadata, or the 2nd positional
    return _kw(c, "common_attn_metadata") or len(c.args) >= 2


def _bases(c: ast.ClassDef) -> list[str]:
    return [ast.unparse(b.value if isinstance(b, ast.Subscript) else b).split(".")[-1] for b in c.bases]


# ---- where the source is ---------------------------------------------------------------------------
def _ascend_dir() -> Path | None:
    url = re.search(r"^VLLM_ASCEND_SDIST_URL\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    d = ROOT / ".cache" / "vllm-ascend" / url.rsplit("/", 1)[1].removesuffix(".tar.gz") / "vllm_ascend"
    return d if d.is_dir() else None


@pytest.fixture(scope="module")
def V() -> Path:
    py = vllm_python()
    if not py.exists():
        pytest.skip(f"no vLLM environment at {py} (make vllm installs it)")
    found = sorted(py.parent.parent.glob("lib/python*/site-packages/vllm"))
    if found:
        return found[-1]
    out = subprocess.run([str(py), "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{py} cannot import vllm: {out.stderr[-2000:]}"
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def A() -> Path:
    d = _ascend_dir()
    if d is None:
        pytest.skip("no vllm-ascend source under .cache/vllm-ascend (make vllm-ascend-src unpacks it)")
    return d


# ---- the pinned vLLM -------------------------------------------------------------------------------
# (file, class, what the plugin reads there)
MEMBERS = [
    ("v1/core/sched/scheduler.py", "Scheduler",
     "requests running finished_req_ids kv_cache_manager block_size vllm_config kv_cache_config"),
    ("v1/core/kv_cache_manager.py", "KVCacheManager", "block_pool get_block_ids"),
    ("v1/core/block_pool.py", "BlockPool", "blocks free_block_queue null_block cached_block_hash_to_block"),
    ("v1/core/kv_cache_utils.py", "KVCacheBlock", "block_id ref_cnt block_hash prev_free_block next_free_block"),
    ("v1/core/kv_cache_utils.py", "FreeKVCacheBlockQueue", "num_free_blocks fake_free_list_head fake_free_list_tail"),
    ("v1/core/sched/output.py", "SchedulerOutput", "scheduled_new_reqs scheduled_cached_reqs num_scheduled_tokens "
     "total_num_scheduled_tokens finished_req_ids preempted_req_ids"),
    ("v1/core/sched/output.py", "NewRequestData", "req_id block_ids num_computed_tokens"),
    ("v1/core/sched/output.py", "CachedRequestData", "req_ids resumed_req_ids new_block_ids num_computed_tokens"),
    ("v1/attention/backend.py", "CommonAttentionMetadata", "query_start_loc_cpu seq_lens block_table_tensor "
     "slot_mapping num_reqs num_actual_tokens positions"),
    ("v1/attention/backend.py", "AttentionMetadataBuilder", "kv_cache_spec layer_names"),
    ("v1/worker/gpu_model_runner.py", "GPUModelRunner", "kv_cache_config input_batch"),
    ("v1/worker/gpu_input_batch.py", "InputBatch", "req_ids"),
    ("v1/worker/gpu/model_runner.py", "GPUModelRunner", "kv_cache_config"),
    ("v1/worker/gpu/input_batch.py", "InputBatch", "req_ids"),
    ("config/vllm.py", "VllmConfig", "max_concurrent_batches"),
    # the ledger's per-group rules and the fault seams (issue 27)
    ("v1/core/single_type_kv_cache_manager.py", "SlidingWindowManager", "get_num_skipped_tokens"),
    ("v1/core/single_type_kv_cache_manager.py", "SingleTypeKVCacheManager", "req_to_blocks block_size"),
    ("v1/core/block_pool.py", "BlockPool", "touch reset_prefix_cache"),
    ("v1/kv_cache_interface.py", "SlidingWindowSpec", "sliding_window extra_retained_tokens"),
    ("v1/kv_cache_interface.py", "ChunkedLocalAttentionSpec", "attention_chunk_size"),
    ("v1/worker/utils.py", "AttentionGroup", "metadata_builders kernel_block_size kernel_block_stride "
     "map_to_kernel_block_table"),
    # the attention check (attention_watch.py, kv_layout.py) and its fault seams (issue 37)
    ("model_executor/layers/attention/attention.py", "Attention", "impl layer_name kv_sharing_target_layer_name"),
    ("v1/attention/backends/cpu_attn.py", "CPUAttentionBackendImpl", "num_heads num_kv_heads head_size scale "
     "sliding_window logits_soft_cap alibi_slopes sinks kv_cache_dtype attn_type kv_sharing_target_layer_name "
     "forward do_kv_cache_update"),
    ("v1/attention/backends/cpu_attn.py", "CPUAttentionMetadata", "query_start_loc seq_lens block_table "
     "scheduler_metadata causal dynamic_causal"),
    ("v1/attention/backends/flash_attn.py", "FlashAttentionImpl", "num_heads num_kv_heads head_size scale "
     "sliding_window logits_soft_cap alibi_slopes kv_cache_dtype forward"),
    ("config/compilation.py", "CompilationConfig", "static_forward_context cudagraph_mode"),
]
# read with getattr and a default: a missing one only narrows a check (a warning, not a failure)
OPTIONAL = [("v1/core/sched/scheduler.py", "Scheduler", "deferred_frees connector")]


@pytest.mark.parametrize("rel,cls,names", MEMBERS, ids=[f"{c}:{r}" for r, c, _ in MEMBERS])
def test_vllm_defines_what_the_plugin_reads(V, rel, cls, names):
    missing = sorted(set(names.split()) - _members(_cls(V, rel, cls)))
    assert not missing, f"{rel}: class {cls} no longer defines {missing} (the plugin reads them)"


def test_vllm_attention_seams(V):
    """The call the attention check wraps and the op kv_layout.py learns the CPU packing from."""
    params = ["self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"]
    _fn(V, "v1/attention/backend.py", "AttentionImpl", "forward", params)
    _fn(V, "v1/attention/backends/cpu_attn.py", "CPUAttentionBackendImpl", "forward", params)
    _fn(V, "v1/attention/backends/cpu_attn.py", "CPUAttentionBackendImpl", "do_kv_cache_update",
        ["self", "layer", "key", "value", "kv_cache", "slot_mapping"])
    _fn(V, "_custom_ops.py", None, "cpu_attn_reshape_and_cache",
        ["key", "value", "key_cache", "value_cache", "slot_mapping", "isa"])
    _fn(V, "_custom_ops.py", None, "cpu_attn_get_scheduler_metadata")
    # the impl is called with the layer first and output by keyword, after the cache write op
    src = (V / "model_executor/layers/attention/attention.py").read_text()
    assert "self.impl.forward(" in src and "do_kv_cache_update(" in src, "attention.py: the impl call sites moved"


def test_vllm_scheduler_hooks(V):
    rel = "v1/core/sched/scheduler.py"
    for meth, params in (("__init__", ["self"]), ("schedule", ["self"]),
                         ("update_from_output", ["self", "scheduler_output", "model_runner_output"]),
                         ("_free_request_blocks", ["self", "request"])):
        _fn(V, rel, "Scheduler", meth, params)
    _fn(V, "v1/core/kv_cache_utils.py", None, "get_block_hash")
    _fn(V, "v1/core/kv_cache_utils.py", None, "maybe_convert_block_hash")
    for rel, cls, names in OPTIONAL:
        gone = sorted(set(names.split()) - _members(_cls(V, rel, cls)))
        if gone:
            warnings.warn(f"{rel}: class {cls} no longer defines {gone}: the pool check's pins will miss them")


def test_vllm_every_step_path_goes_through_update_from_output(V):
    """EngineCore.step_fn is step or step_with_batch_queue, and both call schedule and update_from_output:
    so the pool check runs whichever step path vLLM picks."""
    rel = "v1/engine/core.py"
    tree = _tree(V / rel)
    methods = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    paths = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and any(ast.unparse(t) == "self.step_fn" for t in n.targets):
            paths |= {a.attr for a in ast.walk(n.value) if isinstance(a, ast.Attribute)
                      and ast.unparse(a.value) == "self" and a.attr in methods}
    assert paths == {"step", "step_with_batch_queue"}, (
        f"{rel}: self.step_fn is assigned from {sorted(paths)}, expected step and step_with_batch_queue")
    for p in sorted(paths):
        calls = {ast.unparse(c.func) for c in _calls(_fn(V, rel, "EngineCore", p))}
        for callee in ("self.scheduler.schedule", "self.scheduler.update_from_output"):
            assert callee in calls, f"{rel}: EngineCore.{p} no longer calls {callee}(...); it calls {sorted(calls)}"
    init = ast.unparse(_fn(V, rel, "EngineCore", "__init__"))
    assert "vllm_config.max_concurrent_batches" in init, (
        f"{rel}: EngineCore.__init__ no longer sizes the batch queue from vllm_config.max_concurrent_batches "
        f"(the status line says which step path runs from it)")
    prop = _fn(V, "config/vllm.py", "VllmConfig", "max_concurrent_batches", ["self"])
    assert any(ast.unparse(d) == "property" for d in prop.decorator_list), (
        f"config/vllm.py: VllmConfig.max_concurrent_batches: expected a property, found "
        f"decorators {[ast.unparse(d) for d in prop.decorator_list]}")


def test_vllm_model_runners(V):
    v1, v2 = "v1/worker/gpu_model_runner.py", "v1/worker/gpu/model_runner.py"
    _fn(V, v1, "GPUModelRunner", "execute_model", ["self", "scheduler_output"])
    _fn(V, v1, "GPUModelRunner", "initialize_kv_cache", ["self"])
    cpu = _cls(V, "v1/worker/cpu_model_runner.py", "CPUModelRunner")
    assert "GPUModelRunner" in _bases(cpu), (f"v1/worker/cpu_model_runner.py: CPUModelRunner bases {_bases(cpu)}, "
                                             f"expected GPUModelRunner (the V1 hooks cover it as a subclass)")
    _fn(V, v2, "GPUModelRunner", "execute_model", ["self", "scheduler_output"])
    _fn(V, v2, "GPUModelRunner", "initialize_kv_cache", ["self"])
    prep = _fn(V, v2, "GPUModelRunner", "prepare_inputs", ["self", "scheduler_output"])
    ret = ast.unparse(prep.returns) if prep.returns else None
    assert ret == "InputBatch", f"{v2}: GPUModelRunner.prepare_inputs: expected to return InputBatch, found {ret}"


def test_vllm_runners_reach_builder_build(V):
    """The runners' metadata goes through AttentionMetadataBuilder.build, passed where the wrapper reads it."""
    for rel, cls, fn, callee in (("v1/worker/utils.py", "AttentionGroup", "build_metadata", ".build"),
                                 ("v1/attention/backend.py", "AttentionMetadataBuilder", "build_for_cudagraph_capture",
                                  "self.build"),
                                 ("v1/worker/gpu_model_runner.py", "GPUModelRunner", "_build_attention_metadata",
                                  ".build_metadata"),
                                 ("v1/worker/gpu/attn_utils.py", None, "build_attn_metadata", ".build_metadata")):
        calls = _calls(_fn(V, rel, cls, fn), callee)
        bad = [ast.unparse(c) for c in calls if callee.endswith(".build") and not _passes_metadata(c)]
        assert calls and not bad, (f"{rel}: {cls + '.' if cls else ''}{fn}: expected calls to ...{callee}(...) "
                                   f"passing common_attn_metadata (keyword or 2nd positional), found {len(calls)}, "
                                   f"without it: {bad}")


def _metadata_calls(root: Path, pattern: str) -> dict[str, list[str]]:
    """Outside the builder classes themselves: `.build(...)` calls passing metadata (what the plugin
    sees), and `.update_block_table(...)` calls (metadata made without build: the plugin wraps
    update_block_table too, and checks the group's table against the batch's last metadata)."""
    out: dict[str, list[str]] = {"build": [], "update_block_table": []}
    for f in sorted(root.glob(pattern)):
        text = f.read_text(encoding="utf-8")
        if ".build(" not in text and ".update_block_table(" not in text:
            continue
        tree = _tree(f)
        own = {id(c) for k in ast.walk(tree) if isinstance(k, ast.ClassDef) and "Builder" in k.name
               for c in ast.walk(k)}
        for c in ast.walk(tree):
            if isinstance(c, ast.Call) and id(c) not in own and isinstance(c.func, ast.Attribute) \
                    and c.func.attr in out and (c.func.attr != "build" or _passes_metadata(c)):
                out[c.func.attr].append(f"{f.relative_to(root)}:{c.lineno} {ast.unparse(c.func)}")
    return out


# the files that make attention metadata, as pinned: a new one must be looked at (does its metadata
# reach a builder the plugin wraps?) and then added here
KNOWN_CALLS = {
    "vllm": {"build": {"v1/worker/utils.py", "v1/worker/gpu/model_states/encoder_only.py"},
             "update_block_table": {"v1/worker/gpu_model_runner.py", "v1/worker/gpu/attn_utils.py"}},
    "vllm_ascend": {"build": {"worker/model_runner_v1.py", "worker/v2/attn_utils.py",
                              "spec_decode/llm_base_proposer.py", "spec_decode/step3p5.py"},
                    "update_block_table": set()},
}


@pytest.mark.parametrize("tree", ["vllm", "vllm_ascend"])
def test_metadata_call_sites(request, tree):
    root = request.getfixturevalue("V" if tree == "vllm" else "A")
    found = _metadata_calls(root, "v1/**/*.py" if tree == "vllm" else "**/*.py")
    for kind, known in KNOWN_CALLS[tree].items():
        files = {s.split(":")[0] for s in found[kind]}
        assert files == known, (f"{tree}: the files calling .{kind}(...) on attention metadata changed: "
                                f"new {sorted(files - known)}, gone {sorted(known - files)}; call sites:\n  "
                                + "\n  ".join(found[kind]))


def test_metadata_builders_build_signature(V):
    """Every builder (vLLM's, vllm-ascend's) derives from AttentionMetadataBuilder, so the family wrap
    covers it, and its build takes (self, common_prefix_len, common_attn_metadata, ...)."""
    roots = [r for r in (V, _ascend_dir()) if r is not None]
    idx: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for root in roots:
        for f in root.rglob("*.py"):
            if "MetadataBuilder" in f.read_text(encoding="utf-8"):
                for n in ast.walk(_tree(f)):
                    if isinstance(n, ast.ClassDef):
                        idx.setdefault(n.name, []).append((f"{root.name}/{f.relative_to(root)}", n))

    @functools.lru_cache(maxsize=None)
    def derives(name: str, seen: frozenset = frozenset()) -> bool:
        return name == "AttentionMetadataBuilder" or any(
            derives(b, seen | {name}) for _, c in idx.get(name, ()) for b in _bases(c) if b not in seen)

    problems, checked = [], 0
    for name, defs in idx.items():
        for where, c in defs:
            if any(b.endswith("MetadataBuilder") for b in _bases(c)) and not derives(name):
                problems.append(f"{where}: {name}{tuple(_bases(c))} does not derive from AttentionMetadataBuilder")
            build = next((n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "build"), None)
            if build is None or not derives(name):
                continue
            checked += 1
            got = [a.arg for a in build.args.posonlyargs + build.args.args]
            if got[:3] != ["self", "common_prefix_len", "common_attn_metadata"]:
                problems.append(f"{where}: {name}.build{tuple(got)}: expected (self, common_prefix_len, "
                                f"common_attn_metadata, ...) where hooks.py's wrapper reads the metadata")
    assert checked > 10, f"only {checked} metadata builders with a build found under {roots}"
    assert not problems, "\n".join(problems)


# ---- vllm-ascend ------------------------------------------------------------------------------------
def test_ascend_model_runners(A):
    for rel, module in (("worker/model_runner_v1.py", "vllm.v1.worker.gpu_model_runner"),
                        ("worker/v2/model_runner.py", "vllm.v1.worker.gpu.model_runner")):
        npu = _cls(A, rel, "NPUModelRunner")
        got = [n.module for n in ast.walk(_tree(A / rel))
               if isinstance(n, ast.ImportFrom) and any(a.name == "GPUModelRunner" for a in n.names)]
        assert "GPUModelRunner" in _bases(npu) and got == [module], (
            f"vllm_ascend/{rel}: NPUModelRunner bases {_bases(npu)}, GPUModelRunner imported from {got}: "
            f"expected a subclass of {module}.GPUModelRunner (the hooks cover it as one)")
    # v1: execute_model overridden (no super call), its metadata built by calling builders directly
    _fn(A, "worker/model_runner_v1.py", "NPUModelRunner", "execute_model", ["self", "scheduler_output"])
    _fn(A, "worker/v2/model_runner.py", "NPUModelRunner", "prepare_inputs", ["self", "scheduler_output"])
    for rel, scope in (("worker/model_runner_v1.py", _cls(A, "worker/model_runner_v1.py", "NPUModelRunner")),
                       ("worker/v2/attn_utils.py", _fn(A, "worker/v2/attn_utils.py", None, "build_attn_metadata"))):
        assert any(_kw(c, "common_attn_metadata") for c in _calls(scope, "builder.build")), (
            f"vllm_ascend/{rel}: {getattr(scope, 'name', '')} no longer calls builder.build(common_attn_metadata=...)")
    cm = _cls(A, "attention/utils.py", "AscendCommonAttentionMetadata")
    assert "CommonAttentionMetadata" in _bases(cm), (
        f"vllm_ascend/attention/utils.py: AscendCommonAttentionMetadata bases {_bases(cm)}, "
        f"expected CommonAttentionMetadata (the fields the metadata check reads)")


# ---- the rules the ledger recomputes, against vLLM's own code (run in the vLLM environment) ------
RULES = r"""
import json, torch
from types import SimpleNamespace as NS
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager, ChunkedLocalAttentionManager
from vllm.v1.worker.utils import AttentionGroup
from workbench.adapters.vllm.ledger import GroupRule
from workbench.adapters.vllm.worker_side import kernel_pages
bad = []
for window, retained in ((64, 0), (100, 0), (64, 3)):
    m = object.__new__(SlidingWindowManager)
    m.sliding_window, m.extra_retained_tokens = window, retained
    rule = GroupRule("sliding", window, retained)
    bad += [("sliding", window, retained, c) for c in range(0, 400) if m.get_num_skipped_tokens(c) != rule.skipped(c)]
for chunk in (32, 48):
    m = object.__new__(ChunkedLocalAttentionManager)
    m.attention_chunk_size = chunk
    rule = GroupRule("chunked", chunk)
    bad += [("chunked", chunk, c) for c in range(0, 400) if m.get_num_skipped_tokens(c) != rule.skipped(c)]
# the kernel block table: vLLM's own mapping of a manager block table, against ours
table = torch.tensor([[0, 5, 9], [7, 2, 0]], dtype=torch.int32)
for ratio, stride in ((4, 0), (2, 0), (4, 7)):
    g = object.__new__(AttentionGroup)
    g.kv_cache_spec = NS(block_size=16 * ratio)
    g.kernel_block_size, g.kernel_block_stride = 16, stride
    g.kernel_block_table = torch.zeros(1, 2, 3 * ratio, dtype=torch.int32)
    g.kernel_block_offsets = torch.arange(ratio, dtype=torch.int32)
    got = g.map_to_kernel_block_table(table).tolist()
    want = [kernel_pages(row, ratio, stride or ratio) for row in table.tolist()]
    if got != want:
        bad.append(("kernel", ratio, stride, got, want))
print(json.dumps(bad[:5]))
"""


def test_the_ledgers_window_rules_and_kernel_mapping_match_vllms_code(V):
    # the ledger recomputes which blocks a group may free (GroupRule) and the worker which kernel blocks
    # the kernel reads (kernel_pages); both must agree with vLLM's own functions on every input tried
    from workbench.adapters.vllm.driver import run_python
    out = run_python(RULES)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]
