"""Command-line flags, declared once: on the settings dataclasses' own fields. Torch-free.

A field declared with `option(default, "help")` is a flag: `--field-name` unless the
declaration names another. From that one declaration,

- `add_flags(parser, Settings)` adds the flags to an argparse parser, help showing the default;
- `settings_from_args(Settings, args)` builds the settings from the parsed namespace;
- `to_argv(settings)` turns settings back into the argv that parses to them again, which is
  how `pdserve launch` hands its flags on to the workers and router it starts.

Flags are parsed with no argparse default (None): a flag not given leaves the field at the
dataclass's default, so the dataclass is the only place a default is written. A secret (an
API key, a token) falls back to its environment variable and never goes onto an argv.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

_FLAG = "pdserve.flag"


@dataclasses.dataclass(frozen=True)
class Flag:
    """name: the flag (default: the field's name with dashes). aliases: other names for it
    (vLLM's, for users who carry their command lines over); shown in `--help`, never written
    by `to_argv`. negation: for a bool field, a flag that sets it false (vLLM's
    `--enable-prefix-caching` for `--disable-prefix-caching`). separator: a tuple field
    given as one string split on it (else as several arguments). secret_env: the variable
    a secret is read from when the flag is not given; secrets never go onto an argv."""

    help: str
    name: str | None = None
    aliases: tuple[str, ...] = ()
    negation: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    required: bool = False
    separator: str | None = None
    secret_env: str | None = None


def option(default: Any = dataclasses.MISSING, help: str = "", **flag: Any) -> Any:
    """A dataclass field that is also a command-line flag (see `Flag` for the options)."""
    return dataclasses.field(default=default, metadata={_FLAG: Flag(help, **flag)})


@dataclasses.dataclass(frozen=True)
class _Declared:
    field: str
    flag: Flag
    kind: type  # int, float, str or bool; the element type for a tuple
    is_tuple: bool
    default: Any

    @property
    def name(self) -> str:
        return self.flag.name or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


def declared(settings: type, skip: Iterable[str] = ()) -> list[_Declared]:
    """The flags a settings class declares, in field order, less the fields in `skip`."""
    hints = typing.get_type_hints(settings)
    skipped = set(skip)
    found = []
    for field in dataclasses.fields(settings):
        flag = field.metadata.get(_FLAG)
        if flag is None or field.name in skipped:
            continue
        kind, is_tuple = _kind(hints[field.name])
        found.append(_Declared(field.name, flag, kind, is_tuple, field.default))
    return found


def _kind(hint: Any) -> tuple[type, bool]:
    """`int | None` -> (int, False); `tuple[str, ...] | None` -> (str, True)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = args
        args = list(typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return args[0], True
    if hint not in (int, float, str, bool):
        raise TypeError(f"a flag's field must be int, float, str, bool or a tuple, not {hint}")
    return hint, False


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    settings: type,
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add the flags `settings` declares (less `skip`) to `parser`. defaults: fields whose
    default differs for this command (pass the same to `settings_from_args`)."""
    for d in declared(settings, skip):
        shown = (defaults or {}).get(d.field, d.default)
        if shown is dataclasses.MISSING:
            shown = None
        help_text = d.flag.help
        said = "default" in help_text
        if shown not in (None, False, "", ()) and d.flag.secret_env is None and not said:
            help_text += f" (default: {_text(shown, d.flag.separator)})"
        if d.flag.secret_env:
            help_text += f" (default: ${d.flag.secret_env})"
        # NOTE: argparse expands %-formats in help; a declaration's text is taken literally.
        help_text = help_text.replace("%", "%%")
        options: dict[str, Any] = {"dest": d.dest, "default": None, "help": help_text}
        if d.kind is bool:
            parser.add_argument(d.name, *d.flag.aliases, action="store_true", **options)
            if d.flag.negation:
                parser.add_argument(
                    d.flag.negation,
                    action="store_false",
                    dest=d.dest,
                    default=None,
                    help=f"the opposite of {d.name}" + ("" if d.default else " (the default)"),
                )
            continue
        options.update(type=d.kind, choices=d.flag.choices, metavar=d.flag.metavar)
        if d.flag.required:
            options["required"] = True
        if d.is_tuple and d.flag.separator:
            options["type"] = _splitter(d.kind, d.flag.separator)
        elif d.is_tuple:
            options["nargs"] = "+"
        parser.add_argument(d.name, *d.flag.aliases, **options)


def _splitter(kind: type, separator: str) -> Callable[[str], tuple]:
    def split(text: str) -> tuple:
        return tuple(kind(part.strip()) for part in text.split(separator) if part.strip())

    return split


def given(settings: type, args: argparse.Namespace, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The fields whose flags were given (secrets also from their environment variable)."""
    values = {}
    for d in declared(settings, skip):
        value = getattr(args, d.dest, None)
        if value is None and d.flag.secret_env:
            value = os.environ.get(d.flag.secret_env) or None
        if value is not None:
            values[d.field] = tuple(value) if d.is_tuple else value
    return values


def settings_from_args(
    settings: type,
    args: argparse.Namespace,
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    **fields: Any,
):
    """`settings` built from the flags given in `args` over `defaults`; `fields` win."""
    with named_by_flag(settings, skip):
        return settings(**{**(defaults or {}), **given(settings, args, skip), **fields})


@contextlib.contextmanager
def named_by_flag(settings: type, skip: Iterable[str] = ()):
    """A ValueError from `settings`' checks that begins with a field's name ("page_size
    must be >= 1") begins with its flag instead, as a command line's user knows it (the
    dataclass names the field: right for `LLM(...)` keywords)."""
    try:
        yield
    except ValueError as e:
        message = str(e)
        for d in declared(settings, skip):
            if re.match(rf"{d.field}\b", message):
                e.args = (d.name + message[len(d.field) :], *e.args[1:])
                break
        raise


def to_argv(settings: Any, skip: Iterable[str] = ()) -> list[str]:
    """The flags that parse back to `settings` (fields at their default are left out;
    secrets always are: hand them on with `secret_env`)."""
    argv: list[str] = []
    for d in declared(type(settings), skip):
        value = getattr(settings, d.field)
        if d.flag.secret_env or value is None or value == d.default:
            continue
        if d.kind is bool:
            argv.append(d.name)
        elif d.is_tuple and not d.flag.separator:
            argv += [d.name, *(str(v) for v in value)]
        else:
            argv += [d.name, _text(value, d.flag.separator)]
    return argv


def secret_env(settings: Any) -> dict[str, str]:
    """The environment that hands `settings`' secrets on to a child process."""
    return {
        d.flag.secret_env: getattr(settings, d.field)
        for d in declared(type(settings))
        if d.flag.secret_env and getattr(settings, d.field)
    }


def _text(value: Any, separator: str | None) -> str:
    if isinstance(value, tuple):
        return (separator or " ").join(str(v) for v in value)
    return str(value)
