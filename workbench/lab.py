"""What the notebooks share: the questions they ask, how they show answers, a fault's catalogue card.

Each notebook in notebooks/ is its own source (edited in JupyterLab, paired with a percent-format
.py by jupytext); the few lines several of them need live here, importable and tested, rather
than copied from cell to cell:

    from workbench.lab import QUESTIONS, answers, chat, show_answers, show_fault

    prompts = chat(QUESTIONS)                       # one user message per question
    outs = engine.generate(prompts, params)
    show_answers(QUESTIONS, outs)                   # Q: ... / A: ...
    answers(QUESTIONS, {"fault on": broken, "fault off": fixed})     # side by side
    show_fault("stale_binding")                     # symptom, cause, probe, fix from faults.catalogue()
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

# Three short chat questions with one right answer each: a greedy run's text tells a healthy
# engine ("Paris") from a broken one at a glance.
QUESTIONS = ("What is the capital of France?", "Name three primary colours.", "What is 12 times 12?")

# A paragraph to repeat into long prompts (a long-tail request, a prompt spanning many pages).
PARAGRAPH = ("Paged attention stores the key and value cache of every request in fixed-size pages. "
             "A page table maps each request's token positions to physical pages, so memory is "
             "allocated on demand instead of being reserved for the longest possible request. ")


def chat(questions: Iterable[str]) -> list[list[dict]]:
    """One chat prompt per question: [{"role": "user", "content": q}], what engine.generate takes."""
    if isinstance(questions, str):
        questions = [questions]
    return [[{"role": "user", "content": q}] for q in questions]


def show_answers(questions: Sequence[str], outputs: Sequence, quote: bool = False, width: int | None = None) -> None:
    """Print each question and its answer. quote=True prints the text as a repr, so an empty or
    whitespace answer (what a broken run gives) shows as '' instead of nothing; width cuts long
    questions (a pasted document) to their first `width` characters."""
    if len(questions) != len(outputs):
        raise ValueError(f"{len(questions)} questions but {len(outputs)} outputs")
    for q, o in zip(questions, outputs):
        q = q if width is None else q[:width]
        print(f"Q: {q}\nA: {o.text!r}\n" if quote else f"Q: {q}\nA: {o.text.strip()}\n")


def answers(questions: Sequence[str], runs: Mapping[str, Sequence]):
    """A DataFrame: the questions and, per run (name -> outputs), the answer texts side by side."""
    import pandas as pd
    cols = {"question": list(questions)}
    for name, outs in runs.items():
        if len(outs) != len(questions):
            raise ValueError(f"run {name!r} has {len(outs)} outputs for {len(questions)} questions")
        cols[name] = [o.text for o in outs]
    return pd.DataFrame(cols)


def show_fault(name: str) -> None:
    """Print the fault's row of faults.catalogue(): what production saw, the cause, the probe, the fix."""
    from . import faults
    cat = faults.catalogue().set_index("fault")
    if name not in cat.index:
        raise KeyError(f"no fault named {name!r}; faults: {', '.join(cat.index)}")
    for field, text in cat.loc[name].items():
        print(f"{field:>9}: {text}")
