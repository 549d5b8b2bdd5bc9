"""The policy reference page, generated from the JSON Schema the guard validates policies with, at every build.

An mkdocs hook (``mkdocs.yml``: ``hooks``): ``on_files`` adds ``reference/policy.md``, rendered by :func:`render`
from ``webhook/schema/guardpolicy.schema.json`` (and the cluster facts schema of policy tests), with the bundled
default policy as the annotated example. Nothing is written to ``docs/``: the page cannot go stale, and
``tests/deploy/test_deploy_site.py`` checks that every field of the schema is on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = REPO / "webhook" / "schema"
DEFAULT_POLICY = REPO / "policies" / "default.yaml"
PAGE = "reference/policy.md"

Schema = dict[str, Any] | bool


def _code(value: object) -> str:
    return f"`{json.dumps(value) if not isinstance(value, str) else value}`"


def _ref_name(schema: dict[str, Any]) -> str | None:
    ref = schema.get("$ref")
    return ref.rsplit("/", 1)[-1] if isinstance(ref, str) and ref.startswith("#/$defs/") else None


def _is_object(schema: Schema) -> bool:
    return isinstance(schema, dict) and ("properties" in schema or ("oneOf" in schema and all(
        isinstance(v, dict) and "properties" in v for v in schema["oneOf"])))


class Renderer:
    """Renders one schema: a table of fields per object, and a section per reusable object definition."""

    def __init__(self, schema: dict[str, Any], anchor_prefix: str) -> None:
        self.schema = schema
        self.defs: dict[str, Any] = schema.get("$defs", {})
        self.prefix = anchor_prefix

    def anchor(self, name: str) -> str:
        return f"{self.prefix}-{name}".lower()

    def summary(self, schema: Schema) -> str:
        """What a value may be, in one table cell: its type and constraints, a link for an object definition."""
        if schema is True:
            return "anything"
        if not isinstance(schema, dict):
            return "nothing"
        name = _ref_name(schema)
        if name is not None:
            target = self.defs[name]
            if _is_object(target):
                return f"[{name}](#{self.anchor(name)})"
            return f"{name}: {self.summary(target)}"
        if "allOf" in schema:
            return " and ".join(self.summary(part) for part in schema["allOf"])
        for combiner, word in (("oneOf", " or "), ("anyOf", " or ")):
            if combiner in schema:
                return word.join(self.summary(part) for part in schema[combiner])
        parts: list[str] = []
        if "const" in schema:
            parts.append(f"exactly {_code(schema['const'])}")
        if "enum" in schema:
            parts.append("one of " + ", ".join(_code(v) for v in schema["enum"]))
        kind = schema.get("type")
        if isinstance(kind, list):
            parts.insert(0, " or ".join(kind))
        elif kind is not None and not ("enum" in schema or "const" in schema):
            if kind == "array" and "items" in schema:
                parts.insert(0, f"list of ({self.summary(schema['items'])})")
            elif kind == "object" and isinstance(schema.get("additionalProperties"), dict) \
                    and "properties" not in schema:
                parts.insert(0, f"map of name to ({self.summary(schema['additionalProperties'])})")
            else:
                parts.insert(0, kind)
        for key, text in (("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}"),
                          ("minLength", "at least {} character(s)"), ("maxLength", "at most {} character(s)"),
                          ("minProperties", "at least {} entry(ies)"), ("pattern", "matching `{}`")):
            if key in schema:
                parts.append(text.format(schema[key]))
        if isinstance(schema.get("propertyNames"), dict):
            parts.append(f"names: {self.summary(schema['propertyNames'])}")
        return ", ".join(parts) if parts else "object"

    def rows(self, schema: Schema, path: str) -> list[tuple[str, str, str, str]]:
        """``(field path, value, required, description)`` for every field under an object schema."""
        if not isinstance(schema, dict):
            return []
        found: list[tuple[str, str, str, str]] = []
        required = set(schema.get("required", []))
        for part in schema.get("allOf", []):
            found += self.rows(part, path)
        for name, sub in schema.get("properties", {}).items():
            where = f"{path}.{name}" if path else name
            description = sub.get("description", "") if isinstance(sub, dict) else ""
            found.append((where, self.summary(sub), "yes" if name in required else "", description))
            found += self.nested(sub, where)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and "properties" in schema and _is_object(extra):
            found += self.rows(extra, f"{path}.<name>")
        return found

    def nested(self, schema: Schema, where: str) -> list[tuple[str, str, str, str]]:
        """Rows of an inline object (a defined one has its own section), a map's values, a list's items."""
        if not isinstance(schema, dict) or _ref_name(schema) is not None:
            return []
        if "properties" in schema or "allOf" in schema:
            return self.rows(schema, where)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and (extra.get("properties") or extra.get("allOf")):
            return [(f"{where}.<name>", self.summary(extra), "", ""), *self.rows(extra, f"{where}.<name>")]
        items = schema.get("items")
        if isinstance(items, dict) and "properties" in items:
            return self.rows(items, f"{where}[]")
        return []

    def table(self, rows: list[tuple[str, str, str, str]]) -> str:
        lines = ["| field | value | required | description |", "|---|---|---|---|"]
        lines += [f"| `{p}` | {v} | {r} | {d} |" for p, v, r, d in rows]
        return "\n".join(lines) + "\n"

    def definitions(self) -> str:
        """One section per object definition (a ``oneOf`` of objects: one table per alternative)."""
        out = []
        for name, schema in self.defs.items():
            if not _is_object(schema):
                continue
            out.append(f'### {name} {{ #{self.anchor(name)} }}\n')
            if "description" in schema:
                out.append(schema["description"] + "\n")
            if "oneOf" in schema:
                for alternative in schema["oneOf"]:
                    consts = [f"{k}: {v['const']}" for k, v in alternative["properties"].items()
                              if isinstance(v, dict) and "const" in v]
                    out.append(f"When `{', '.join(consts) or 'this alternative'}`:\n")
                    merged = {**alternative, "required": alternative.get("required", schema.get("required", []))}
                    out.append(self.table(self.rows(merged, "")))
            else:
                out.append(self.table(self.rows(schema, "")))
        return "\n".join(out)


def render() -> str:
    """The policy reference page (Markdown)."""
    policy = json.loads((SCHEMAS / "guardpolicy.schema.json").read_text("utf-8"))
    facts = json.loads((SCHEMAS / "clusterfacts.schema.json").read_text("utf-8"))
    guard = Renderer(policy, "policy")
    facts_renderer = Renderer(facts, "facts")
    return "\n".join([
        "# Policy reference\n",
        "Generated at every build of this site from `webhook/schema/guardpolicy.schema.json`, the JSON Schema the "
        "guard validates every policy with (`csinode-guard policy validate`, `serve`, hot reload): what is listed "
        "here is exactly what is accepted. What the rules do with these fields: [Concepts](../concepts.md); how "
        "to try a policy before it enforces anything: [Policies](../policies.md).\n",
        "## GuardPolicy\n",
        guard.table(guard.rows(policy, "")),
        "## Definitions\n",
        guard.definitions(),
        "## The bundled default policy\n",
        "`policies/default.yaml`, also inside the wheel and the Helm chart, with its comments: the example of "
        "every field above.\n",
        "```yaml\n" + DEFAULT_POLICY.read_text("utf-8").rstrip("\n") + "\n```\n",
        "## Cluster facts files (policy tests)\n",
        "`csinode-guard policy test` and `evaluate --facts` read the cluster's facts from a file validated "
        "against `webhook/schema/clusterfacts.schema.json`:\n",
        facts_renderer.table(facts_renderer.rows(facts, "")),
        facts_renderer.definitions(),
    ])


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated page to the site's files."""
    from mkdocs.structure.files import File  # noqa: PLC0415 - only when mkdocs builds

    files.append(File.generated(config, PAGE, content=render()))
    return files
