"""The plan table on the quantisation page is the plan `backend_engine/accel/plan.py` gives each
device class: a form changed in the code alone, or in the page alone, fails here."""

from __future__ import annotations

import re

from backend_engine.accel.plan import DEVICE_CLASSES, FORMATS, plan_for
from tests.docs.docs_paths import DOCS

PAGE = DOCS / "engine" / "quantization.md"
START, END = "<!-- plan-table:start -->", "<!-- plan-table:end -->"


def documented_rows() -> list[tuple[str, ...]]:
    text = PAGE.read_text()
    assert text.count(START) == 1 and text.count(END) == 1, f"{PAGE.name} needs one {START} … {END}"
    table = text.split(START)[1].split(END)[0].strip().splitlines()
    assert table[0].startswith("| device class |") and set(table[1]) <= set("|-")
    return [tuple(cell.strip().strip("`") for cell in line.strip("|").split("|"))
            for line in table[2:]]


def planned_rows() -> list[tuple[str, ...]]:
    rows = []
    for cls in DEVICE_CLASSES:
        plan = plan_for("cuda") if cls == "cuda" else plan_for("cpu", {"device_class": cls})
        for fmt in FORMATS:
            lm_head = "dense" if fmt == "fp" else plan.lm_head
            rows.append((cls, fmt, plan.decode[fmt], plan.prompt[fmt], lm_head,
                         "yes" if plan.compiled else "no"))
    return rows


def test_the_page_shows_the_plan_the_code_gives():
    assert documented_rows() == planned_rows()


def test_every_form_in_the_table_is_described_on_the_page():
    text = PAGE.read_text()
    # the lm_head's int8 and int4 run the decode rows' form; w8a8 is a form of its own
    forms = {cell for row in planned_rows() for cell in row[2:4]} | {"w8a8", "reference"}
    for form in forms:
        assert re.search(rf"^\*\*`{form}`\*\* —", text, re.M), f"no paragraph for the {form} form"
