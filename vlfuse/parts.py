"""Parts chosen by type: a registry of config dataclasses, each the config of one part it builds.

A model is made of parts (:mod:`vlfuse.fusers`, :mod:`vlfuse.heads`), each with a small config of
its own, chosen in a config file by its ``type``::

    fuser:
      type: cell_steps
      heads: 16

:class:`Registry` turns such a mapping into the part's config (its options checked, by name, with
the file's wording), and :meth:`PartConfig.to_dict` turns it back. A part's options are the
fields of its config class: an option that another part has, but this one lacks, is an error.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Generic, Mapping, TypeVar


TOKENS, EVIDENCE = "tokens", "evidence"
"""What a fuser gives its head: question tokens ``(Bq, Lt, dim)`` or one number per question ``(Bq,)``."""


@dataclasses.dataclass
class PartConfig:
    """Base of a part's config. Each subclass declares ``type: str = "<its name>"`` as its first field."""

    def __post_init__(self) -> None:
        name = type_name(type(self))
        if getattr(self, "type", name) != name:
            raise ValueError(f"{type(self).__name__} has type {name!r}, got type={self.type!r}")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, ``type`` first: what a config file or ``config.json`` holds."""
        return dataclasses.asdict(self)


def type_name(config_class: type[PartConfig]) -> str:
    """The ``type`` a config class is selected by: the default of its ``type`` field."""
    spec = config_class.__dataclass_fields__.get("type")
    if spec is None or not isinstance(spec.default, str):
        raise TypeError(f"{config_class.__name__} needs a first field `type: str = \"<name>\"`")
    return spec.default


Config = TypeVar("Config", bound=PartConfig)


class Registry(Generic[Config]):
    """The parts of one kind (``fuser``, ``head``), by ``type``.

    Args:
        kind: what the parts are, as a config names them (``"fuser"``).
        default: the ``type`` of a mapping that names none.
    """

    def __init__(self, kind: str, default: str) -> None:
        self.kind, self.default = kind, default
        self.configs: dict[str, type[Config]] = {}

    def register(self, config_class: type[Config]) -> type[Config]:
        """Class decorator: make ``config_class`` selectable by its ``type``."""
        name = type_name(config_class)
        if name in self.configs:
            raise ValueError(f"a {self.kind} of type {name!r} is already registered ({self.configs[name].__qualname__})")
        self.configs[name] = config_class
        return config_class

    def parse(self, value: Config | Mapping[str, Any], where: str | None = None) -> Config:
        """``value`` as a part config: a config as it is, or a mapping with ``type`` (default :attr:`default`)
        and options; errors name ``where`` (default: the kind) and the option."""
        where = where or self.kind
        if isinstance(value, PartConfig):
            if type(value) not in self.configs.values():
                raise ValueError(f"{where} must be a {self.kind} config (one of {sorted(self.configs)}), got {type(value).__name__}")
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a mapping with a type and its options, got {value!r}")
        options = dict(value)
        name = options.setdefault("type", self.default)
        if not isinstance(name, str) or name not in self.configs:
            raise ValueError(f"{where}.type must be one of {sorted(self.configs)}, got {name!r}")
        config_class = self.configs[name]
        fields = {spec.name: spec for spec in dataclasses.fields(config_class) if spec.init}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            known = ", ".join(n for n in fields if n != "type") or "none"
            raise ValueError(f"{where}: a {self.kind} of type {name!r} has no option {', '.join(unknown)} (its options: {known})")
        hints = typing.get_type_hints(config_class)
        for key, option in options.items():
            check_type(f"{where}.{key}", option, hints[key])
        return config_class(**options)


def check_type(where: str, value: Any, hint: Any) -> None:
    """A ``ValueError`` naming ``where`` when ``value`` is not of the simple type ``hint`` (int, float,
    bool, str, a Literal, a list or dict of them, items and values checked too, or an Optional of
    one); other hints pass."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return
        hints = [a for a in args if a is not type(None)]
        errors = []
        for option in hints:
            try:
                return check_type(where, value, option)
            except ValueError as err:
                errors.append(err)
        raise errors[0]
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{where} must be one of {list(args)}, got {value!r}")
        return
    expected = {int: (int,), float: (int, float), bool: (bool,), str: (str,), list: (list, tuple), dict: (dict,)}
    base = origin or hint
    if base not in expected:
        return
    ok = isinstance(value, expected[base]) and not (base in (int, float) and isinstance(value, bool))
    if not ok:
        raise ValueError(f"{where} must be {getattr(base, '__name__', base)}, got {value!r}")
    if base is list and len(args) == 1:
        for index, item in enumerate(value):
            check_type(f"{where}[{index}]", item, args[0])
    elif base is dict and len(args) == 2:
        for key, item in value.items():
            check_type(f"{where}[{key!r}]", item, args[1])


MAX_LAYERS, MAX_HEADS, MAX_WIDTH, MAX_IMAGE_SIDE, MAX_TOKENS, MAX_VOCAB = 1024, 1024, 1 << 16, 1 << 13, 1 << 16, 1 << 24
"""The largest sizes a config may give (far above the largest models: ViT-22B has 48 blocks of width
6144): a config file or a model folder's ``config.json`` past them is refused before anything is built."""
MAX_MLP_RATIO = 64.0
"""The largest ratio of an MLP's hidden width to its input's (transformers use 4)."""


def check_fields(config: Any, where: str) -> None:
    """Check each field of the dataclass ``config`` against its simple type (see :func:`check_type`);
    errors name ``where.field``."""
    hints = typing.get_type_hints(type(config))
    for spec in dataclasses.fields(config):
        check_type(f"{where}.{spec.name}", getattr(config, spec.name), hints[spec.name])


def check_mlp_ratio(where: str, value: float) -> None:
    """A ``ValueError`` naming ``where`` unless ``value`` is above 0 and at most :data:`MAX_MLP_RATIO`."""
    if not 0 < value <= MAX_MLP_RATIO:
        raise ValueError(f"{where} must be above 0 and at most {MAX_MLP_RATIO:g}, got {value}")


def check_range(where: str, value: int | None, low: int, high: int) -> None:
    """A ``ValueError`` naming ``where`` when ``value`` (``None`` passes) is not between ``low`` and ``high``."""
    if value is not None and not low <= value <= high:
        raise ValueError(f"{where} must be between {low} and {high}, got {value}")
