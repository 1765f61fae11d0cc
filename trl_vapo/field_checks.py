"""Checks of a dataclass's number fields as a YAML file or the Python API can fill them: argparse converts only
strings, so a YAML `null`, `8.0` or a list's `1e-1` (YAML 1.1 reads an exponent without a dot as text) reach the
dataclass unconverted. No heavy imports: the command line's own arguments use it before transformers loads."""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Any

# The number fields by their annotation (a string here, a type in transformers' TrainingArguments): the number they
# hold (an int is a float's number too), and whether None is one of their values.
_NUMBER_FIELDS = {
    "int": (int, False),
    "int | None": (int, True),
    "float": ((int, float), False),
    "float | None": ((int, float), True),
}


# The text fields by their annotation: whether None is one of their values.
_TEXT_FIELDS = {"str": False, "str | None": True}


def _annotated(cls: type, kinds: dict[str, Any]) -> dict[str, Any]:
    """`cls`'s fields whose annotation is one of `kinds`, each with its kind, from the classes' annotations (not the
    fields' `type`, which transformers' HfArgumentParser rewrites in place: `float | None` becomes `float`)."""
    found = {}
    for klass in reversed(cls.__mro__):
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
            found.pop(name, None)  # a subclass's annotation replaces its base's
            if text in kinds:
                found[name] = kinds[text]
    declared = {spec.name for spec in fields(cls)}
    return {name: kind for name, kind in found.items() if name in declared}


@functools.cache
def number_fields(cls: type) -> dict[str, tuple[type | tuple[type, ...], bool]]:
    """`cls`'s number fields: `{name: (number, optional)}`."""
    return _annotated(cls, _NUMBER_FIELDS)


def check_text_fields(instance) -> None:
    """A ValueError naming the first text field of `instance` that holds something else: YAML reads an unquoted
    `{question}` as a mapping, `2024` as a number, `no` as false (a template's field reached `str.format` as a dict:
    a TypeError's traceback)."""
    for name, optional in _annotated(type(instance), _TEXT_FIELDS).items():
        value = getattr(instance, name)
        if not isinstance(value, str) and not (value is None and optional):
            raise ValueError(
                f"{name} must be text{' or None' if optional else ''}, got {value!r} (a {type(value).__name__}): in a "
                f'YAML file, quote it ({name}: "..."), as YAML reads {{...}} as a mapping and 2024 as a number.'
            )


def check_number_fields(instance) -> None:
    """A ValueError naming the first number field of `instance` that holds what is not its number (they failed later
    in a comparison, `None >= 1`: a TypeError's traceback, or where a whole number indexes). A bool is not a number
    here, though Python counts it one."""
    for name, (number, optional) in number_fields(type(instance)).items():
        value = getattr(instance, name)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, number):
            what = "a whole number" if number is int else "a number"
            raise ValueError(
                f"{name} must be {what}{' or None' if optional else ''}, got {value!r}"
                + ("" if value is None else f" (a {type(value).__name__})")
                + "."
            )
        if value != value:  # NaN (`.nan` in YAML): it passed every range check, all False, and meant nothing
            raise ValueError(f"{name} must be a number, got nan.")


def number_list(values, name: str) -> list[float] | None:
    """`values` (a list field of numbers, or one number) as a list of numbers, text read as a number (`"1e-1"`, which
    a YAML list holds for `[1e-1, 1]`); a ValueError naming `name` for anything else."""
    if values is None:
        return None
    items = values if isinstance(values, (list, tuple)) else [values]
    numbers = []
    for item in items:
        if isinstance(item, str):
            try:
                item = float(item)
            except ValueError:
                item = None
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise ValueError(f"{name} must be a list of numbers, got {values!r}")
        numbers.append(item)
    return numbers
