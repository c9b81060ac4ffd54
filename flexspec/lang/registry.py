"""The named pattern registry: ``patterns/*.yaml``, one pattern per file. The only YAML reader.

Each file is validated when the registry is first used: known keys only, the right types, a
definition that parses and checks, constraints and defaults that parse, an example that checks.
A malformed file raises :class:`RegistryError` naming the file and line.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from flexspec import ir
from flexspec.lang import ast
from flexspec.lang.checker import check_definition, check_spec
from flexspec.lang.definitions import SCALAR_TYPES, Definition, ParamSpec, Scope
from flexspec.errors import RegistryError, Source, SpecError, did_you_mean
from flexspec.lang.parser import parse_expr, parse_spec, parse_type
from flexspec.resources import data_path

KINDS = ("mask", "score")
REQUIRED_KEYS = ("name", "kind", "summary", "definition", "references", "example")
OPTIONAL_KEYS = ("description", "params", "aliases", "tags", "align")
PARAM_KEYS = ("name", "type", "default", "constraint", "doc")


@dataclass(frozen=True)
class Reference:
    title: str
    url: str


@dataclass(frozen=True)
class Pattern:
    """A registry entry: a named mask or score modifier with its documentation."""

    name: str
    kind: str
    params: tuple
    summary: str
    description: str
    definition: str
    references: tuple
    aliases: tuple
    tags: tuple
    example: str
    align: str = "start"
    path: str = field(default="", compare=False)
    body: ast.Node = field(default=None, compare=False, repr=False)

    def signature(self) -> str:
        return self.as_definition().signature()

    def as_definition(self) -> Definition:
        return Definition(self.name, self.kind, self.params, self.body, origin=self.path,
                          align=self.align)


def patterns_dir() -> Path:
    """The folder of pattern files: inside the package when installed, at the top of a checkout."""
    path = data_path("patterns")
    if path is not None and path.is_dir():
        return path
    raise RegistryError("the pattern folder is missing: the installation is incomplete")


class _File:
    """One YAML file: its parsed data plus the marks needed to point at a line."""

    def __init__(self, path: Path):
        self.path = path
        self.name = str(path)
        data = path.read_bytes()
        try:
            self.text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start)
            column = err.start - (data.rfind(b"\n", 0, err.start) + 1)
            raise RegistryError(f"not UTF-8 text: byte 0x{data[err.start]:02x} cannot start a "
                                "character; save the file as UTF-8", source_name=self.name,
                                line=line + 1, column=column + 1) from None
        try:
            self.root = yaml.compose(self.text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            raise RegistryError(f"not valid YAML: {getattr(err, 'problem', err)}",
                                source_name=self.name,
                                line=mark.line + 1 if mark else None,
                                column=mark.column + 1 if mark else None) from None
        except RecursionError:
            raise RegistryError("the YAML is nested too deeply to read", source_name=self.name,
                                line=1, column=1) from None
        if not isinstance(self.root, yaml.MappingNode):
            self.fail("a pattern file must be a mapping of keys such as name, kind, definition",
                      self.root)

    def fail(self, message: str, node=None):
        mark = node.start_mark if node is not None else None
        raise RegistryError(message, source_name=self.name,
                            line=mark.line + 1 if mark else 1,
                            column=mark.column + 1 if mark else 1)

    def mapping(self, node, allowed: tuple, required: tuple, what: str) -> dict:
        if not isinstance(node, yaml.MappingNode):
            self.fail(f"{what} must be a mapping", node)
        result = {}
        for key_node, value_node in node.value:
            key = key_node.value
            if key not in allowed:
                self.fail(f"unknown key '{key}' in {what}.{did_you_mean(key, allowed)} "
                          f"Allowed keys: {', '.join(allowed)}", key_node)
            if key in result:
                self.fail(f"key '{key}' appears twice in {what}", key_node)
            result[key] = value_node
        for key in required:
            if key not in result:
                self.fail(f"{what} lacks the required key '{key}'", node)
        return result

    def string(self, node, what: str) -> str:
        if not isinstance(node, yaml.ScalarNode) or node.tag.endswith((":int", ":float", ":bool", ":null")):
            self.fail(f"{what} must be text", node)
        return node.value

    def strings(self, node, what: str) -> tuple:
        if not isinstance(node, yaml.SequenceNode):
            self.fail(f"{what} must be a list", node)
        return tuple(self.string(item, f"each entry of {what}") for item in node.value)

    def source(self, node, what: str) -> Source:
        """The text of a scalar (``what`` names it in the error when it is not one) as a Source
        placed where it stands in the file."""
        self.string(node, what)
        line, column = node.start_mark.line, node.start_mark.column
        if node.style in ('"', "'"):
            column += 1
        elif node.style in ("|", ">"):
            line += 1
            following = self.text.splitlines()[line] if line < len(self.text.splitlines()) else ""
            column = len(following) - len(following.lstrip())
        return Source(node.value, self.name, line_offset=line, column_offset=column)

    def scalar(self, node, what: str):
        """A plain YAML value (number, bool, text); other nodes and tags are refused."""
        if not isinstance(node, yaml.ScalarNode):
            self.fail(f"{what} must be a single value, not a list or mapping", node)
        try:
            return yaml.safe_load(yaml.serialize(node))
        except yaml.YAMLError as err:
            self.fail(f"{what} is not a plain value ({getattr(err, 'problem', None) or err}); "
                      "write a number, true/false, or an expression in quotes", node)


def _default_node(file: _File, node) -> ast.Node:
    value = file.scalar(node, "a default")
    if isinstance(value, bool):
        return ast.Bool(value)
    if isinstance(value, int):
        return ast.Int(value)
    if isinstance(value, float):
        if math.isnan(value):
            file.fail("a default cannot be NaN", node)
        return ast.Float(value)
    if isinstance(value, str):
        return parse_expr(file.source(node, "a default"))
    file.fail("a default must be a number, true/false, or an expression in quotes", node)


def _load_param(file: _File, node) -> ParamSpec:
    keys = file.mapping(node, PARAM_KEYS, ("name", "type"), "a parameter")
    name = file.string(keys["name"], "a parameter's name")
    type_node = parse_type(file.source(keys["type"], "a parameter's type"))
    if type_node.name not in SCALAR_TYPES:
        file.fail(f"parameter type '{type_node.name}' is unknown; use int, float or bool, with "
                  "dims for a tensor: int[B, KV_LEN]", keys["type"])
    default = _default_node(file, keys["default"]) if "default" in keys else None
    constraint = parse_expr(file.source(keys["constraint"], "a constraint")) \
        if "constraint" in keys else None
    doc = file.string(keys["doc"], "doc") if "doc" in keys else ""
    return ParamSpec(name, type_node.name, type_node.dims, default, constraint, doc)


def load_pattern(path: Path) -> tuple[Pattern, _File, dict]:
    """Read and validate the shape of one pattern file (its definition is checked later)."""
    file = _File(path)
    keys = file.mapping(file.root, REQUIRED_KEYS + OPTIONAL_KEYS, REQUIRED_KEYS, "a pattern file")
    name = file.string(keys["name"], "name")
    if name != path.stem:
        file.fail(f"the pattern is named '{name}' but its file is '{path.name}'; they must agree",
                  keys["name"])
    kind = file.string(keys["kind"], "kind")
    if kind not in KINDS:
        file.fail(f"kind must be 'mask' or 'score', not '{kind}'", keys["kind"])
    params_node = keys.get("params")
    params = ()
    if params_node is not None and not (isinstance(params_node, yaml.ScalarNode)
                                        and params_node.tag.endswith(":null")):
        if not isinstance(params_node, yaml.SequenceNode):
            file.fail("params must be a list of parameters", params_node)
        params = tuple(_load_param(file, p) for p in params_node.value)
        names = [p.name for p in params]
        for i, pname in enumerate(names):
            if pname in names[:i]:
                file.fail(f"parameter '{pname}' is declared twice", params_node.value[i])
    references = []
    refs_node = keys["references"]
    if not isinstance(refs_node, yaml.SequenceNode) or not refs_node.value:
        file.fail("references must be a non-empty list of {title, url}", refs_node)
    for ref in refs_node.value:
        ref_keys = file.mapping(ref, ("title", "url"), ("title", "url"), "a reference")
        url = file.string(ref_keys["url"], "url")
        if not url.startswith(("http://", "https://")):
            file.fail("a reference url must start with http:// or https://", ref_keys["url"])
        references.append(Reference(file.string(ref_keys["title"], "title"), url))
    body = parse_expr(file.source(keys["definition"], "definition"))
    align = file.string(keys["align"], "align") if "align" in keys else "start"
    if align not in ir.ALIGNMENTS:
        file.fail(f"align must be 'start' or 'end', not '{align}'", keys["align"])
    pattern = Pattern(
        name=name, kind=kind, params=params,
        summary=file.string(keys["summary"], "summary"),
        description=file.string(keys["description"], "description").strip() if "description" in keys else "",
        definition=file.string(keys["definition"], "definition"),
        references=tuple(references),
        aliases=file.strings(keys["aliases"], "aliases") if "aliases" in keys else (),
        tags=file.strings(keys["tags"], "tags") if "tags" in keys else (),
        example=file.string(keys["example"], "example"), align=align,
        path=str(path), body=body)
    return pattern, file, keys


class Registry:
    """All patterns, checked, with the scope that resolves their names and aliases."""

    def __init__(self, directory: Path):
        self.directory = directory
        loaded = [load_pattern(p) for p in sorted(directory.glob("*.yaml"))]
        self.patterns: dict[str, Pattern] = {}
        aliases: dict[str, str] = {}
        for pattern, file, keys in loaded:
            self.patterns[pattern.name] = pattern
        for pattern, file, keys in loaded:
            for alias in pattern.aliases:
                if alias in self.patterns or alias in aliases:
                    file.fail(f"alias '{alias}' is already taken", keys["aliases"])
                aliases[alias] = pattern.name
        self.scope = Scope([p.as_definition() for p in self.patterns.values()], aliases)
        for pattern, file, keys in loaded:
            try:
                check_definition(pattern.as_definition(), self.scope)
                check_spec(parse_spec(pattern.example, f"{file.name} (example)"), self.scope)
            except RegistryError:
                raise
            except SpecError as err:
                raise RegistryError(err.message, err.span, source_name=err.source_name or file.name,
                                    line=err.line, column=err.column) from None

    def get(self, name: str) -> Pattern:
        target = self.scope.aliases.get(name, name)
        if target not in self.patterns:
            hint = did_you_mean(name, set(self.patterns) | set(self.scope.aliases))
            raise RegistryError(f"no pattern named '{name}'.{hint} `flexspec list` shows them all")
        return self.patterns[target]


@functools.lru_cache(maxsize=None)
def _registry(directory: str) -> Registry:
    return Registry(Path(directory))


def registry() -> Registry:
    """The default registry, loaded and checked once."""
    return _registry(str(patterns_dir()))
