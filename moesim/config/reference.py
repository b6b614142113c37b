"""The scenario-key reference, generated from the config classes: every key a scenario file
takes, its type, default and meaning, section by section, and every registered policy with
its parameters (the docs site's "Scenario keys" page is :func:`markdown`)."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

from moesim.config.confload import help_of, yaml_name


@dataclass(frozen=True)
class Key:
    """One scenario key: its dotted path, type, default (as YAML writes it) and meaning."""

    path: str
    type: str
    default: str
    help: str
    section: str  # the dotted path of the section it belongs to ('' for the top level)


def _optional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` as (X, True); any other hint as (hint, False)."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(get_args(hint)) == 2:
            return args[0], True
    return hint, False


def _type_name(hint: Any) -> str:
    hint, optional = _optional(hint)
    if get_origin(hint) is Literal:
        text = " \\| ".join(str(a) for a in get_args(hint))
    elif get_origin(hint) is dict:
        text = "mapping"
    elif dataclasses.is_dataclass(hint) or hint is Any:
        text = "section"
    else:
        text = {int: "integer", float: "number", bool: "true \\| false", str: "text"}.get(hint, str(hint))
    return text + (" or null" if optional else "")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value) or isinstance(value, dict):
            return ""
    else:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _walk(cls: type, prefix: str, out: list[Key]) -> None:
    hints = get_type_hints(cls)
    section = prefix.rstrip(".")
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("internal"):
            continue
        key = prefix + yaml_name(f)
        inner, _ = _optional(hints[f.name])
        sub: Any = f.metadata.get("section") or (inner if dataclasses.is_dataclass(inner) else None)
        if get_origin(inner) is dict and dataclasses.is_dataclass(get_args(inner)[1]):
            out.append(Key(key, "mapping of name to section", "", help_of(f), section))
            _walk(get_args(inner)[1], key + ".NAME.", out)
        elif sub is not None:
            out.append(Key(key, "section", "", help_of(f), section))
            _walk(sub, key + ".", out)
        elif hints[f.name] is Any:  # a mapping the scenario's own code reads (policies, sweep)
            out.append(Key(key, "mapping", "", help_of(f), section))
        else:
            out.append(Key(key, _type_name(hints[f.name]), _default(f), help_of(f), section))


def scenario_keys() -> list[Key]:
    """Every key of a scenario file, sections in the order a file writes them."""
    from moesim.config.scenario import _TopLevel

    out: list[Key] = []
    _walk(_TopLevel, "", out)
    return out


def markdown() -> str:
    """The reference as Markdown: a table per section."""
    keys = scenario_keys()
    sections: dict[str, list[Key]] = {}
    for k in keys:
        sections.setdefault(k.section, []).append(k)
    lines: list[str] = []
    for name, rows in sections.items():
        lines += [f"## `{name}`" if name else "## Top level", "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for k in rows:
            short = k.path[len(name) + 1:] if name else k.path
            default = k.default if k.default in ("", "(required)") else f"`{k.default}`"
            lines.append(f"| `{short}` | {k.type} | {default} | "
                         f"{k.help.replace('|', chr(92) + '|')} |")
        lines.append("")
    return "\n".join(lines)


def plain(text: str) -> str:
    """A docstring's first paragraph as plain text (reStructuredText roles and literals dropped)."""
    import re

    first = " ".join((text or "").strip().split("\n\n")[0].split())
    first = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", first)
    return first.replace("``", "")


def policies_markdown() -> str:
    """Every registered policy by family: its name, parameters (type, default, meaning) and
    what it does, as Markdown."""
    from moesim.config.confload import describe_fields
    from moesim.policies import families

    lines: list[str] = []
    for fam, reg in families().items():
        lines += [f"## `policies.{fam}`", "", "| name | parameters | what it does |", "|---|---|---|"]
        for name, cls in reg.items():
            params = "<br>".join(f"`{n}` ({t}, default `{d!r}`): {h}" for n, t, d, h in describe_fields(cls.Params))
            lines.append(f"| `{name}` | {params or '-'} | {plain(cls.__doc__ or '').replace('|', chr(92) + '|')} |")
        lines.append("")
    return "\n".join(lines)
