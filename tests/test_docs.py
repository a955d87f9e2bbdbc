"""The docs say what the code does: docs/methods.md's option defaults come from the Options classes."""

import re
from pathlib import Path

from fedskew.algorithms import COMPONENTS, METHODS, options_reference

ROOT = Path(__file__).resolve().parents[1]
METHODS_MD = (ROOT / "docs/methods.md").read_text()


def test_options_reference_is_generated_from_the_code():
    begin, end = "<!-- options-reference: begin -->\n", "<!-- options-reference: end -->"
    section = METHODS_MD[METHODS_MD.index(begin) + len(begin):METHODS_MD.index(end)]
    assert section == options_reference(), "docs/methods.md is stale: regenerate it with `fedskew methods --markdown`"


def _same(printed: str, default) -> bool:
    printed = re.split(r"[:\s/]", printed.strip())[0].strip("`")  # `code`: the ..., `a`/`b`, 1: the classifier
    if default is None:
        return printed.lower() == "none"
    if isinstance(default, bool):
        return printed.lower() == str(default).lower()
    if isinstance(default, (int, float)):
        try:
            return float(printed) == float(default)
        except ValueError:
            return False
    return printed == str(default)


def prose_defaults() -> list[tuple[str, str, str]]:
    """(method, option, printed default) of every ``| `method` | `option` (default ...`` cell in the
    hand-written tables of docs/methods.md (the generated section excluded)."""
    text = METHODS_MD[:METHODS_MD.index("## Options reference")]
    found = []
    for row in text.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 2 or not re.fullmatch(r"`[a-z_0-9]+`", cells[0]):
            continue
        name = cells[0].strip("`")
        if name not in METHODS:
            continue
        for option, value in re.findall(r"`([a-zA-Z_0-9]+)` \(([^,;)]+)", cells[1]):
            found.append((name, option, value))
    return found


def test_every_default_printed_in_the_method_tables_is_the_code_default():
    rows = prose_defaults()
    assert len(rows) > 40  # the tables were read
    wrong = []
    for name, option, printed in rows:
        fields = METHODS[name].Options.model_fields
        if option not in fields:
            wrong.append(f"{name}: '{option}' is not an option")
            continue
        default = fields[option].get_default(call_default_factory=True)
        if not _same(printed, default):
            wrong.append(f"{name}.{option}: docs say {printed.strip()}, code {default!r}")
    assert not wrong, wrong


def test_component_options_have_one_name_wherever_attached():
    """A named method built from a component takes the component's options under the component's
    names (issue 30: rs_form vs form, proto_share_fraction vs share_fraction)."""
    from fedskew.algorithms.compose import Composed

    for name, cls in METHODS.items():
        if not (isinstance(cls, type) and issubclass(cls, Composed)):
            continue
        method = cls()
        for comp in method.components:
            schema = type(comp.opt)
            shared = set(schema.model_fields) & set(cls.Options.model_fields)
            for option in shared:
                assert getattr(comp.opt, option) == getattr(method.opt, option), (name, option)
    assert set(COMPONENTS["rs"].Options.model_fields) <= set(METHODS["map"].Options.model_fields)
    assert set(COMPONENTS["prototypes"].Options.model_fields) <= set(METHODS["fedmr"].Options.model_fields)


def test_the_registry_holds_classes_only():
    from fedskew.algorithms.base import Method

    assert all(isinstance(cls, type) and issubclass(cls, Method) for cls in METHODS.values())


def test_every_option_of_every_method_and_component_says_what_it_means():
    missing = [f"{name}.{key}" for name, cls in {**METHODS, **COMPONENTS}.items()
               for key, field in cls.Options.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"options without a meaning: {missing}"
