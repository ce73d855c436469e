"""`make test-as-avx2`: torch's own CPU probes answer as on an AVX2-only host, in every Python process.

That target runs the whole suite as an AMD EPYC without AVX-512 would, on a host that has it:
ATen's kernels are held to AVX2 (ATEN_CPU_CAPABILITY), oneDNN and MKL too (ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS), our kernels are built for x86-64-v3 under a faked CPU (PAGEDKV_CPU_FEATURES,
PAGEDKV_MARCH). What those leave is code that asks torch what the silicon has: vLLM's CPU platform
loads its AVX-512 kernel library when `torch.cpu._is_avx512_supported()` says yes, and that library with
oneDNN held to AVX2 aborts, where a real AVX2-only host loads `vllm._C_AVX2`. So here those probes say
no. The target puts this directory on PYTHONPATH, so Python imports this file at start-up, in our
environment and in vLLM's alike; it patches torch.cpu only when something imports torch (most processes
here never do), so it costs nothing where torch is not used. It takes the place of any other
sitecustomize further down the path (a distribution's own, say), which that target does not need.
"""
import functools
import importlib.abc
import importlib.machinery
import sys
import types

# torch.cpu's probes of the silicon; each answers False on an AVX2-only x86 CPU
HIDDEN = ("_is_avx512_supported", "_is_vnni_supported", "_is_avx512_bf16_supported",
          "_is_amx_tile_supported", "_is_amx_fp16_supported")
# and the features torch.cpu.get_capabilities() reports (vLLM reads it too), cleared where they start so:
# AVX-512, AMX, AVX10 and the VEX-coded VNNI / bf16-convert extensions, which no AVX2-only EPYC has
HIDDEN_FEATURES = ("avx512", "amx", "avx10", "avx_vnni", "avx_ne_convert")


def _no() -> bool:
    return False


def _as_avx2(get_capabilities):
    @functools.lru_cache(None)                     # as torch's own: cached, read-only
    def get_avx2_capabilities() -> types.MappingProxyType:
        caps = dict(get_capabilities())
        caps.update({k: False for k, v in caps.items() if k.startswith(HIDDEN_FEATURES) and isinstance(v, bool)})
        return types.MappingProxyType(caps)
    return get_avx2_capabilities


def _patch(module) -> None:
    if hasattr(module, "get_capabilities"):      # torch 2.13's _is_* read it when called
        module.get_capabilities = _as_avx2(module.get_capabilities)
    for name in HIDDEN:                           # and where they ask torch._C directly
        if hasattr(module, name):
            setattr(module, name, _no)


class _TorchCpuAsAvx2(importlib.abc.MetaPathFinder):
    """Finds torch.cpu as the path finder does and patches the module once it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if module.__name__ == "torch.cpu":     # a loader shared with other modules leaves them alone
                _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _TorchCpuAsAvx2())
