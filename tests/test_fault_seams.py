"""Issue 30: faults change the engine only through declared seams.

Fault.patch replaces an attribute only where the class declares it (FAULT_SEAMS, each with its
contract): every fault of the catalogue that runs on one device switches on and off through those
seams alone, and a fault reaching for anything else (a private method) is refused, naming the class,
the attribute and the seams it does declare, with the engine left as it was."""
import pytest

from workbench import Engine, EngineConfig, SamplingParams, faults
from workbench.faults.base import Fault, seams_of

ONE_DEVICE = [n for n in faults.FAULTS if n != "rank_desync"]        # rank_desync needs tensor parallel


@pytest.mark.parametrize("name", ONE_DEVICE)
def test_every_fault_patches_only_declared_seams(tiny_llama_dir, name):
    kw = {"kv_cache_dtype": "float16"} if name == "fp16_kv_overflow" else {}
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64, **kw))
    f = faults.make(eng, name)
    f.enable()
    try:
        for obj, attr, _old, _had in f._undo:
            assert attr in seams_of(obj), (name, type(obj).__name__, attr)
            assert getattr(obj, attr) is not _old                # the seam really holds the fault's version
    finally:
        f.disable()
    out = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3                               # undone: the engine runs clean


def test_a_fault_reaching_past_the_seams_is_refused(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=64))

    class PrivateReach(Fault):
        name = "private_reach"

        def on_enable(self):
            self.patch(self.engine.builder, "build", self.engine.builder.build)      # a seam: fine
            self.patch(self.engine.scheduler, "_preempt", lambda seq: None)         # not one

    before = eng.scheduler._preempt
    f = PrivateReach(eng)
    with pytest.raises(TypeError, match=r"PrivateReach: Scheduler\._preempt is not a declared fault seam "
                                        r"\(declared: \['finish'\]\)"):
        f.enable()
    f.disable()
    assert eng.scheduler._preempt == before and "build" not in vars(eng.builder)
    assert seams_of(eng.builder) == {"build"} and seams_of(eng.attn) >= {"page_reader"}
