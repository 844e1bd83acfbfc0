"""One codec for the JSON reports: a frozen dataclass to a JSON object and back, driven by its fields' types.

A report class subclasses :class:`JsonReport` and is a frozen dataclass; its wire form is
one JSON key per field, named as the field. :meth:`JsonReport.to_json` gives that object
(keys in sorted order, as ``encode_json`` puts them on the wire); :meth:`JsonReport.from_json`
checks an object against the fields' types and builds the report, or raises a
ProtocolError naming the field that is wrong or missing. A field the reader does not know is
left out: a newer node may report more than an older client reads, and nodes roll first.

Field types the codec reads: ``int`` (never a bool), ``float`` (an int or a float, kept as
sent), ``bool``, ``str``, another :class:`JsonReport`, ``dict[str, T]`` of those, ``dict[str, Any]``
(any object, as it is) and ``T | None``. Every field is required on the wire unless its :func:`wire`
options say what its absence means (a dataclass default is the constructor's, not the wire's).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, TypeVar, Union

from backend.errors import ProtocolError

__all__ = ["JsonReport", "wire", "read_json"]

R = TypeVar("R", bound="JsonReport")

_ABSENT = "json_absent"  # value a field decodes to when the object lacks it
_ABSENT_AS = "json_absent_as"  # name of the field whose value it takes instead
_OMIT_DEFAULT = "json_omit_default"  # left out of the object while it equals its default


def wire(*, absent: Any = dataclasses.MISSING, absent_as: str = "", omit_default: bool = False) -> dict[str, Any]:
    """A report field's wire options, as its ``dataclasses.field(metadata=...)``: ``absent`` (the value it
    takes when a node, of an earlier version, leaves it out), ``absent_as`` (take another field's value
    then) and ``omit_default`` (a node leaves the field out while it has its default)."""
    return {_ABSENT: absent, _ABSENT_AS: absent_as, _OMIT_DEFAULT: omit_default}


class JsonReport:
    """Base of a report that is a frozen dataclass and a JSON object on the wire (this module's docstring)."""

    what: ClassVar[str] = "a report"  # how an error names the object

    def to_json(self) -> dict[str, Any]:
        """The JSON object this report is on the wire: one key per field, in sorted order."""
        body = {}
        for f in sorted(dataclasses.fields(self), key=lambda f: f.name):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.metadata.get(_OMIT_DEFAULT) and value == f.default:
                continue
            body[f.name] = _encode(value)
        return body

    @classmethod
    def from_json(cls: type[R], body: Any) -> R:
        """The report ``body`` is, checked field by field; ProtocolError naming the field that is wrong."""
        if not isinstance(body, dict):
            raise ProtocolError(f"{cls.what} is {str(body)[:80]}, not an object")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for name, f in fields.items():
            if name in body:
                values[name] = _decode(hints[name], body[name], f"{cls.what}: {name!r}")
            elif f.metadata.get(_ABSENT, dataclasses.MISSING) is not dataclasses.MISSING:
                absent = f.metadata[_ABSENT]
                values[name] = dict(absent) if isinstance(absent, dict) else absent  # never one dict shared
            elif not f.metadata.get(_ABSENT_AS):
                raise ProtocolError(f"{cls.what}: field {name!r} is missing")
        for name, f in fields.items():  # a field absent as another takes its value once that one is read
            if name not in values and f.metadata.get(_ABSENT_AS):
                values[name] = values[f.metadata[_ABSENT_AS]]
        return cls(**values)


def read_json(kind: Any, value: Any, what: str) -> Any:
    """``value`` checked as ``kind``, a type a report's field may have (``dict[str, TierReport]``, ...);
    ProtocolError naming ``what`` otherwise."""
    return _decode(kind, value, what)


def _encode(value: Any) -> Any:
    if isinstance(value, JsonReport):
        return value.to_json()
    if isinstance(value, dict):
        return {name: _encode(item) for name, item in value.items()}
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The fields' types of ``cls``, resolved once (the reports' annotations are strings)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _decode(kind: Any, value: Any, what: str) -> Any:
    """``value`` checked as ``kind`` (a field's type); ProtocolError naming ``what`` otherwise."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (Union, _UNION_TYPE):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value, what)
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{what} is {str(value)[:80]}, not an object")
        if args[1] is Any:
            return value
        return {str(name): _decode(args[1], item, f"{what}[{str(name)[:80]!r}]") for name, item in value.items()}
    if isinstance(kind, type) and issubclass(kind, JsonReport):
        return kind.from_json(value)
    accepted = _SCALARS.get(kind)
    if accepted is None:
        raise TypeError(f"the report codec reads no field of type {kind!r}")
    if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError(f"{what} is {str(value)[:80]}, not {kind.__name__}")
    return value


_UNION_TYPE = type(int | None)  # ``X | None`` (typing.Union is ``Optional[X]``)
_SCALARS: dict[Any, tuple[type, ...]] = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}
