"""Parsing YAML documents with limits: duplicate keys refused, alias expansion ("billion laughs") bounded.

Policies, driver profiles, policy tests and the cluster facts files of ``evaluate`` and ``replay`` are read
with :func:`load_yaml`. Pure: imports only PyYAML.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["MAX_ALIASES", "MAX_ALIAS_EXPANSION", "load_yaml"]

MAX_ALIASES = 100
"""Aliases (``*name``) a policy, policy-test or facts document may use at most."""
MAX_ALIAS_EXPANSION = 10_000
"""Nodes the aliases of one document may add once expanded (a "billion laughs" document adds billions)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last one silently), and
    aliases beyond :data:`MAX_ALIASES` uses or :data:`MAX_ALIAS_EXPANSION` expanded nodes.

    PyYAML shares the node an alias names, so parsing stays small; what reads the document afterwards (the
    schema validation, the policy hash) walks every alias in full, so nested aliases cost exponential time and
    memory there. They are refused before anything reads the document.
    """

    _aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                event = self.peek_event()  # type: ignore[no-untyped-call]
                raise yaml.composer.ComposerError(
                    None, None, f"more than {MAX_ALIASES} aliases (refused: alias expansion)", event.start_mark
                )
        return super().compose_node(parent, index)

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if self._aliases and node is not None:
            _check_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _check_expansion(root: yaml.Node) -> None:
    """Raise ``yaml.YAMLError`` when expanding every alias under ``root`` adds more than
    :data:`MAX_ALIAS_EXPANSION` nodes, or an alias contains itself. Linear in the nodes as written."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()
    written = 0

    def size(node: yaml.Node) -> int:
        nonlocal written
        key = id(node)
        known = sizes.get(key)
        if known is not None:
            return known
        if key in in_progress:
            raise yaml.composer.ComposerError(None, None, "an alias that contains itself", node.start_mark)
        in_progress.add(key)
        written += 1
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        in_progress.discard(key)
        sizes[key] = total
        if total - written > MAX_ALIAS_EXPANSION:
            raise yaml.composer.ComposerError(
                None, None, f"aliases expand to more than {MAX_ALIAS_EXPANSION} extra nodes (refused: alias "
                "expansion)", node.start_mark,
            )
        return total

    size(root)


def load_yaml(text: str) -> Any:
    """Parse one YAML document, refusing duplicate keys and alias expansion beyond a small bound
    (:data:`MAX_ALIASES`, :data:`MAX_ALIAS_EXPANSION`); raises ``yaml.YAMLError``.

    Nesting deeper than the interpreter's recursion limit and integers beyond Python's 4300-digit conversion
    limit are refused as ``yaml.YAMLError`` too (PyYAML lets them escape as RecursionError and ValueError).
    """
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    except (ValueError, TypeError) as exc:  # the int conversion limit; a mapping key that cannot be hashed
        raise yaml.YAMLError(str(exc)) from None
