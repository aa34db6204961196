"""YAML for the files a user writes (study files, search spaces): PyYAML's safe loader, with a key given twice in one
mapping an error naming the key and both lines. PyYAML keeps the last value silently: a study file's second
`budget:` would wipe the first one's `max_trials`, a space's second `ngram:` branch replace the first."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode

MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping names one key twice (a `yaml.YAMLError`, so callers that report bad YAML report it too)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key repeated in one mapping. Keys a merge (`<<: *anchor`) brings in may be
    overridden, as YAML intends."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base constructor reports it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise DuplicateKeyError(
                    None, None, f"duplicate key {key!r} on line {line} (first on line {first}): the second would "
                    "silently replace the first. Fix: merge the two into one key", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def safe_load_unique(text: str) -> Any:
    """`yaml.safe_load` with duplicate keys refused (`DuplicateKeyError`)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


__all__ = ["DuplicateKeyError", "UniqueKeyLoader", "safe_load_unique"]
