"""The schema machinery every recipe section is written with: ``doc`` (a field and everything said about it), the
numbers a field allows (``Range``), what it needs (``Needs``), the conversion of YAML values to the field's type
(``build_section``) and the checks of ranges and needs that collect every problem at once.

The sections themselves are in ``finetune.config``; a task's own ``ModelConfig`` / ``DataConfig`` use the same ``doc``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


def _show(bound) -> str:
    """A bound as the messages write it: 2**32 - 1 (a seed's upper end) by name, other numbers as they are."""
    return "2**32 - 1" if bound == 2**32 - 1 else str(bound)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Range:
    """The numbers a field allows: a lower and/or an upper bound, each included or not; for a list field, how many
    numbers it holds, each within the bounds. Declared on the field through ``doc(at_least=…, above=…, at_most=…,
    below=…, length=…)``, so that validation, error messages and help text come from one place.

        >>> r = Range(low=0, high=1, high_open=True)
        >>> r.allows(0), r.allows(1), r.describe(float)
        (True, False, 'in [0, 1)')
    """

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    length: Optional[int] = None

    def _within(self, x) -> bool:
        return ((self.low is None or (x > self.low if self.low_open else x >= self.low))
                and (self.high is None or (x < self.high if self.high_open else x <= self.high)))

    def allows(self, value) -> bool:
        """Whether ``value`` (already of the field's type) is allowed. What the type allows besides numbers (null,
        auto) is not a number and passes: the range bounds the numbers only."""
        if self.length is not None:
            return value is None or (isinstance(value, list) and len(value) == self.length
                    and all(_is_number(x) and self._within(x) for x in value))
        return not _is_number(value) or self._within(value)

    def bounds(self) -> str:
        """``>= 1``, ``> 0``, ``in [0, 1)``, ``<= 1`` …; for a list field ``2 numbers in [0, 1)`` (the help text's)."""
        if self.low is None and self.high is None:
            return f"{self.length} numbers"
        if self.low is not None and self.high is not None:
            text = (f"in {'(' if self.low_open else '['}{_show(self.low)}, {_show(self.high)}"
                    f"{')' if self.high_open else ']'}")
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_show(self.low)}"
        else:
            text = f"{'<' if self.high_open else '<='} {_show(self.high)}"
        return f"{self.length} numbers {text}" if self.length is not None else text

    def describe(self, tp) -> str:
        """What follows ``must be`` in an error message, for a field of type ``tp``: ``an integer >= 1 or null``,
        ``a number > 0``, ``in [0, 1)`` (an interval says it is a number), ``an integer >= 1 or auto``."""
        options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        others = [a for a in options if typing.get_origin(a) is Literal or a is type(None)]
        alternatives = ["null" if a is type(None) else " or ".join(map(str, typing.get_args(a))) for a in others]
        if self.length is not None:
            text = self.bounds()
        elif int in options:
            text = f"an integer {self.bounds()}"
        elif self.low is not None and self.high is not None:
            text = self.bounds()
        else:
            text = f"a number {self.bounds()}"
        return " or ".join([text, *alternatives])


@dataclass(frozen=True)
class Needs:
    """What a field needs when it is set: a package, or another setting. Declared on the field
    (``doc(needs=…)``) and checked on load with the field's range (``check_needs``), so that ``finetune validate``
    lists it with every other problem and a run refuses it before any data is read or model loaded.

    Args:
        package: (the module looked up, what ``pip install`` installs it from), as the optimizer table writes it
            (``optimizers.Optimizer.needs``); or a function of the field's value giving that pair, or None where
            the value needs nothing (``training.optimizer`` asks the table).
        setting: another field, ``section.name``, that must be set (true, or not null).
        when: the values that need it; None: any value but the field's default, null and false.
        why: what the line says after the setting it names, in brackets.

        >>> @dataclass
        ... class Data:
        ...     pack: Optional[str] = doc("pack rows", None, needs=Needs(package=("no_such_module", "no-such")))
        >>> problems = []
        >>> check_needs(Data(pack="bfd"), "data", problems)
        >>> problems
        ['data.pack: bfd needs no_such_module, which is not installed (pip install no-such)']
    """

    package: Union[tuple, typing.Callable, None] = None
    setting: Optional[str] = None
    when: Optional[typing.Callable[[Any], bool]] = None
    why: str = ""


def always(_value) -> bool:
    """``Needs.when`` for a field whose every value needs it (its default too)."""
    return True


@dataclass(frozen=True)
class Said:
    """What ``doc`` is told about a field besides its help text and default (its keywords, one record).

    Args:
        flag: the command-line flag that sets it (``finetune run --batch-size``), if any.
        alias: another name for it in ``test_fine_tuning()`` and ``finetune search --param`` (``n_epochs``).
        affects_result: False when changing it between a checkpoint and its resumption leaves the steps alone
            (worker count, logging, checkpoint cadence); resuming warns about the others.
        at_least, above: the lowest allowed number, included (``>=``) or not (``>``); give one at most.
        at_most, below: the highest allowed number, included (``<=``) or not (``<``); give one at most.
        length: for a list of numbers: how many it holds (the bounds apply to each).
        choices: for a string field whose values live in a table elsewhere (``finetune.optimizers``): returns the
            allowed values, asked at each validation, so that an entry added to the table is allowed at once (a
            ``Literal`` would freeze them when the schema is imported).
        needs: what the field needs when it is set (``Needs``; a tuple of them for several): a package, another
            setting. Checked on load beside the range (``check_needs``).

        >>> Said(at_least=1).range().bounds()
        '>= 1'
    """

    flag: Optional[str] = None
    alias: Optional[str] = None
    affects_result: bool = True
    at_least: Any = None
    above: Any = None
    at_most: Any = None
    below: Any = None
    length: Optional[int] = None
    choices: Optional[typing.Callable[[], tuple]] = None
    needs: Union[Needs, tuple, None] = None

    def range(self) -> Optional[Range]:
        """The ``Range`` the bounds declare; None without any. TypeError for two bounds on one side."""
        if (self.at_least is not None and self.above is not None) or \
                (self.at_most is not None and self.below is not None):
            raise TypeError("doc(): give at_least or above, at_most or below — one bound a side")
        bounds = (self.at_least, self.above, self.at_most, self.below)
        if all(b is None for b in bounds) and self.length is None:
            return None
        return Range(low=self.above if self.above is not None else self.at_least,
                     high=self.below if self.below is not None else self.at_most,
                     low_open=self.above is not None, high_open=self.below is not None, length=self.length)

    def metadata(self, text: str) -> dict:
        """The field's metadata: its help (``text``, ending with the range), flag, alias, range, choices, needs."""
        allowed = self.range()
        needs = (self.needs,) if isinstance(self.needs, Needs) else tuple(self.needs or ())
        return {"help": f"{text}; allowed: {allowed.bounds()}" if allowed else text, "flag": self.flag,
                "alias": self.alias, "affects_result": self.affects_result, "range": allowed,
                "choices": self.choices, "needs": needs}


# keywords of ``dataclasses.field`` that ``doc`` hands on (the rest are ``Said``'s)
FIELD_KEYWORDS = ("default_factory", "init", "repr", "compare", "hash", "kw_only")


def doc(text: str, default=dataclasses.MISSING, **said):
    """A dataclass field and everything said about it, in one place.

    Args:
        text: help text, unit included (the recipe docs, ``--help`` and error messages use it).
        default: the default value.
        said: ``Said``'s keywords (flag, alias, affects_result, at_least / above / at_most / below, length, choices,
            needs), and ``dataclasses.field``'s (``default_factory``); another keyword is a TypeError.

    The bounds become a ``Range`` in the field's metadata (``metadata["range"]``): every recipe section is checked
    against it on load (``check_ranges``), and the help text ends with it (``; allowed: >= 1``).

        >>> @dataclass
        ... class Section:
        ...     epochs: int = doc("passes over the training data", 1, at_least=1)
        >>> problems = []
        >>> check_ranges(Section(epochs=0), "training", problems)
        >>> problems
        ['training.epochs: got 0; must be an integer >= 1']
    """
    kw = {k: said.pop(k) for k in FIELD_KEYWORDS if k in said}
    if default is not dataclasses.MISSING:
        kw["default"] = default
    return field(metadata=Said(**said).metadata(text), **kw)

# ---------------------------------------------------------------------------------------------------------------
# typed conversion


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string", dict: "a mapping",
            list: "a list"}.get(tp, getattr(tp, "__name__", str(tp)))


_NO = object()


def _coerce(value, tp):
    """Return value converted to tp, or _NO."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            out = _coerce(value, arg)
            if out is not _NO:
                return out
        return _NO
    if origin is Literal:
        if value is False and "no" in typing.get_args(tp):  # YAML 1.1 reads `mixed_precision: no` as false
            return "no"
        return value if value in typing.get_args(tp) and not isinstance(value, bool) else _NO
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        if isinstance(value, bool):
            return _NO
        if isinstance(value, str):  # YAML reads 5e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                return _NO
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    if tp in (dict, list):
        return value if isinstance(value, tp) else _NO
    if origin in (dict, list):
        return value if isinstance(value, origin) else _NO
    return value


def build_section(cls, raw, section: str, problems: list):
    """Instantiate dataclass ``cls`` from mapping ``raw``, appending a line to ``problems`` for each bad field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{section}: must be a mapping of keys to values")
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key in getattr(cls, "RETIRED", {}):  # a key a release took away: say what replaced it
            problems.append(f"{section}.{key}: {cls.RETIRED[key]}")
            continue
        if key not in known:
            problems.append(f"{section}.{key}: unknown key; allowed: {', '.join(known)}")
            continue
        out = _coerce(value, hints[key])
        choices = known[key].metadata.get("choices")
        allowed = choices() if choices else None
        if out is _NO or (allowed is not None and out not in allowed):
            expected = " | ".join(map(repr, allowed)) if allowed is not None else _type_name(hints[key])
            problems.append(f"{section}.{key}: got {value!r}; expected {expected}")
            continue
        kwargs[key] = out
    return cls(**kwargs)


def check_ranges(section, prefix: str, problems: list) -> None:
    """One ``prefix.name: got …; must be …`` line per field of the dataclass instance ``section`` whose value is
    outside the range its ``doc(...)`` declares; fields without one are not checked here.

        >>> problems = []
        >>> check_ranges(TrainingConfig(epochs=0), "training", problems)  # finetune.config's
        >>> problems
        ['training.epochs: got 0; must be an integer >= 1']
    """
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        allowed, value = f.metadata.get("range"), getattr(section, f.name)
        if allowed is not None and not allowed.allows(value):
            problems.append(f"{prefix}.{f.name}: got {value}; must be {allowed.describe(hints[f.name])}")


def check_needs(section, prefix: str, problems: list, sections: Optional[dict] = None) -> None:
    """One line per field of the dataclass instance ``section`` that is set to a value needing what is missing: a
    package not installed, another setting not set (the ``Needs`` its ``doc(...)`` declares). ``sections``: section
    name → section, where a needed setting outside ``section`` is looked up (the recipe's). A value its range
    refuses is reported by the range alone.

        >>> problems = []
        >>> check_needs(TrainingConfig(batch_size="auto"), "training", problems)  # finetune.config's
        >>> problems
        ['training.batch_size: auto needs training.effective_batch_size (the window the micro-batches split)']
    """
    sections = {**(sections or {}), prefix: section}
    for f in dataclasses.fields(section):
        value, allowed = getattr(section, f.name), f.metadata.get("range")
        if allowed is not None and not allowed.allows(value):
            continue
        for need in f.metadata.get("needs", ()):
            if not (need.when(value) if need.when is not None else is_set(value, f)):
                continue
            shown = yaml_value(value)
            package = need.package(value) if callable(need.package) else need.package
            if package is not None:
                need_package(f"{prefix}.{f.name}", shown, *package, problems)
            if need.setting is not None:
                where, name = need.setting.split(".")
                other = getattr(sections[where], name)
                if other is None or other is False:
                    wanted = f"{need.setting}=true" if isinstance(other, bool) else need.setting
                    problems.append(f"{prefix}.{f.name}: {shown} needs {wanted}"
                                    + (f" ({need.why})" if need.why else ""))


def is_set(value, f: dataclasses.Field) -> bool:
    """Whether field ``f`` holds ``value`` on purpose: not null, not false, not its default."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return value is not None and value is not False and value != default


def yaml_value(value) -> str:
    """A value as a recipe writes it: true / false / null, other values as they are."""
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


def in_range(section, name: str) -> bool:
    """Whether field ``name`` of ``section`` is within its declared range (True without one). A cross-field check
    asks it first, so that a value its range refuses is reported once, by the range."""
    allowed = next(f.metadata.get("range") for f in dataclasses.fields(section) if f.name == name)
    return allowed is None or allowed.allows(getattr(section, name))


def installed(module: str) -> bool:
    """The one question asked of a missing package (a test replaces it, ``schema.installed``, for a machine without
    one): whether ``module`` is installed (looked up, not imported: importing bitsandbytes takes seconds). Every refusal
    of a missing package asks here (``check_needs``)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def need_package(field: str, value: str, module: str, pip: str, problems: list) -> None:
    """One line when ``field: value`` needs ``module`` and it is not installed (``pip``: what installs it)."""
    if not installed(module):
        problems.append(f"{field}: {value} needs {module}, which is not installed (pip install {pip})")

