"""workbench.lab, the notebooks' shared set-up: prompts, answers printed and side by side, a fault's card."""
from types import SimpleNamespace

import pytest

from workbench import faults
from workbench.lab import PARAGRAPH, QUESTIONS, answers, chat, show_answers, show_fault


def out(text):
    return SimpleNamespace(text=text)


def test_chat_makes_one_user_message_per_question():
    assert chat(QUESTIONS[:2]) == [[{"role": "user", "content": "What is the capital of France?"}],
                                   [{"role": "user", "content": "Name three primary colours."}]]
    assert chat("Hi") == [[{"role": "user", "content": "Hi"}]]           # a lone question, not its letters
    assert len(QUESTIONS) == 3 and PARAGRAPH.endswith(" ")              # repeats cleanly: PARAGRAPH * k


def test_show_answers_prints_question_and_answer(capsys):
    show_answers(["Q one?", "Q two?"], [out(" Paris.\n"), out("")])
    assert capsys.readouterr().out == "Q: Q one?\nA: Paris.\n\nQ: Q two?\nA: \n\n"
    show_answers(["Q one?", "Q two?"], [out(" Paris.\n"), out("")], quote=True)     # an empty answer shows
    assert capsys.readouterr().out == "Q: Q one?\nA: ' Paris.\\n'\n\nQ: Q two?\nA: ''\n\n"
    show_answers(["Summarise: " + PARAGRAPH * 3], [out("ok")], width=9)        # a pasted document, cut
    assert capsys.readouterr().out == "Q: Summarise\nA: ok\n\n"
    with pytest.raises(ValueError, match="2 questions but 1 outputs"):
        show_answers(["a", "b"], [out("x")])


def test_answers_puts_runs_side_by_side():
    df = answers(["a?", "b?"], {"fault on": [out(""), out("x")], "fault off": [out("A"), out("x")]})
    assert list(df.columns) == ["question", "fault on", "fault off"]
    assert df.to_dict("list") == {"question": ["a?", "b?"], "fault on": ["", "x"], "fault off": ["A", "x"]}
    with pytest.raises(ValueError, match="'short' has 1 outputs for 2 questions"):
        answers(["a?", "b?"], {"short": [out("")]})


def test_show_fault_prints_the_catalogue_card(capsys):
    row = faults.catalogue().set_index("fault").loc["stale_binding"]
    show_fault("stale_binding")
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"{field:>9}: {text}" for field, text in row.items()]
    assert any(line.lstrip().startswith("notebook: notebooks/stale_binding.ipynb") for line in printed)
    with pytest.raises(KeyError, match="no fault named 'stale'"):
        show_fault("stale")
