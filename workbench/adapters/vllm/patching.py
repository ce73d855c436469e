"""Wrapping a method on a class and on every subclass that overrides it, now and later.

vLLM's paths differ in which subclass does the work: the V1 and V2 model runners, the CPU
runner, vllm-ascend's NPUModelRunner (which overrides execute_model without calling super),
and every attention backend's metadata builder each define their own method. Wrapping the
base alone misses the overrides; wrapping them one by one misses those imported later
(vllm-ascend's builders load with its platform). So a family wrap covers the base, every
subclass defined so far, and, through __init_subclass__, every subclass defined after.

An override that calls super() would run the check twice: the wrapper passes `outer=False`
to the hook inside such a nested call (one flag per thread and method name), so the hook
knows it is not the outermost call.
"""
from __future__ import annotations

import functools
import threading

_depth = threading.local()
_MARK = "__pagedkv_wrapped__"


def _all_subclasses(cls):
    seen, todo = [], [cls]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s not in seen:
                seen.append(s)
                todo.append(s)
    return seen


def wrap_family(base: type, name: str, make) -> list[str]:
    """Wrap `name` on `base` and its subclasses that define it. make(original) returns
    wrapper(self, *args, outer: bool, **kwargs). Returns the classes wrapped (qualified names)."""
    key = f"{base.__qualname__}.{name}"
    wrapped: list[str] = []

    def wrap(cls) -> None:
        fn = cls.__dict__.get(name)
        if fn is None or getattr(fn, _MARK, False) or not callable(fn):
            return
        hook = make(fn)

        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            depth = getattr(_depth, key, 0)
            setattr(_depth, key, depth + 1)
            try:
                return hook(self, *args, outer=depth == 0, **kwargs)
            finally:
                setattr(_depth, key, depth)

        setattr(method, _MARK, True)
        setattr(cls, name, method)
        wrapped.append(f"{cls.__module__}.{cls.__qualname__}")

    for cls in [base, *_all_subclasses(base)]:
        wrap(cls)

    # subclasses defined from now on (a platform plugin imported after ours)
    previous = base.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kw):
        if previous is not None:
            previous.__func__(cls, **kw)
        else:
            super(base, cls).__init_subclass__(**kw)
        try:
            wrap(cls)
        except Exception:                  # never break a class definition of vLLM's
            pass

    base.__init_subclass__ = classmethod(__init_subclass__)
    return wrapped
