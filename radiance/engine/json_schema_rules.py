"""What of a JSON schema structured output can hold a model to, for the grammar engine (xgrammar 0.2.9).

xgrammar compiles more of JSON Schema than it enforces: some keywords it ignores, some combinations it serves as
something weaker, and some constructs it turns into text that is not JSON. A request's schema therefore passes
through two steps here:
  - `check_json_schemas`: refuses, naming the place, what would be compiled but not enforced (a 400 beats an
    answer that breaks the schema with finish_reason "stop"), and what would take minutes to compile;
  - `served_schema`: rewrites what can be served exactly another way, before xgrammar reads the schema
    (json_schema_grammar mends the grammar xgrammar makes of it, and compiles it).
Tools' parameters are schemas written for models, not grammars: they are not refused for unenforced keywords
(but for a `strict` function's), but are rewritten, so that a forced call's arguments are always JSON.
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any, NoReturn

from radiance.errors import StructuredOutputError

# xgrammar's compile time grows with these faster than linearly, on a thread no request can cancel (xgrammar
# 0.2.9, 2-core host: 20,000 string enum values 27 s, 100,000 7 min; a pattern "^a{50000}$" 2 min; 20,000 choices
# 13 s). OpenAI allows 1,000 enum values per schema; a pattern's repetition counts are bounded in all.
MAX_ENUM_VALUES = 1000
MAX_PATTERN_REPEATS = 4096
MAX_SCHEMA_DEPTH = 100  # subschemas nested in one another: 300 took 1 s to compile, 600 9 s, 2,000 minutes
# keywords xgrammar 0.2.9 compiles but does not enforce (its grammar would let through text the schema refuses)
_UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependencies", "$dynamicRef",
                        "$recursiveRef", "contains", "minContains", "maxContains", "dependentRequired")
# keywords that constrain a value: xgrammar serves $ref, anyOf and oneOf alone, ignoring any of these beside them
# (annotations, definitions, vendor `x-` keys and OpenAPI's `nullable` constrain nothing and may stand there)
_ASSERTIONS = frozenset(("type", "enum", "const", "properties", "required", "additionalProperties",
                         "patternProperties", "propertyNames", "minProperties", "maxProperties", "items", "prefixItems",
                         "additionalItems", "minItems", "maxItems", "uniqueItems", "minLength", "maxLength", "pattern",
                         "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                         "allOf", "anyOf", "oneOf", "$ref", "unevaluatedItems", "unevaluatedProperties"))
# keywords xgrammar reads only with the "type" they belong to (without it, "maxLength": 2 let 923 through)
_TYPED_KEYWORDS = ("minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
                   "exclusiveMaximum", "multipleOf")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# keywords whose value is one subschema, a list of them, or a map of name to subschema
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
              "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# characters a JSON string must escape; xgrammar writes a pattern's literal ones unescaped (a pattern with `\\`
# gave {"v": "a.b\c2"}), while its wildcards and negated classes already leave them out
_MUST_ESCAPE = frozenset([ord('"'), ord("\\")] + list(range(0x20)))


def check_json_schemas(schemas: dict[str, Any], what: str, keywords: bool = True) -> None:
    """StructuredOutputError when `schemas` (parsed JSON, by the name of their root in messages: "#" for a
    request's schema) are too large to compile in reasonable time together (MAX_ENUM_VALUES,
    MAX_PATTERN_REPEATS) or, with `keywords`, use what the grammar would not enforce (named with its place)."""
    budget = {"enum values": 0, "pattern repeats": 0}
    for root, schema in schemas.items():
        _check_subschema(schema, root, budget, what, keywords, 0, schema)
    if budget["enum values"] > MAX_ENUM_VALUES:
        raise StructuredOutputError(f"{what}: {budget['enum values']} enum and const values in all, more than "
                                    f"the {MAX_ENUM_VALUES} allowed")
    if budget["pattern repeats"] > MAX_PATTERN_REPEATS:
        raise StructuredOutputError(f"{what}: pattern repetition counts ({{n,m}}) of {budget['pattern repeats']} "
                                    f"in all, more than the {MAX_PATTERN_REPEATS} allowed")


def _check_subschema(schema: Any, where: str, budget: dict, what: str, keywords: bool, depth: int,
                     root: Any) -> None:
    if not isinstance(schema, dict):
        return  # true / false, or a malformed value xgrammar names itself
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(f"{what}: subschemas nested more than {MAX_SCHEMA_DEPTH} deep")
    if keywords:
        _check_enforceable(schema, where, what, root)
    budget["enum values"] += len(schema["enum"]) if isinstance(schema.get("enum"), list) else 0
    budget["enum values"] += "const" in schema
    if isinstance(schema.get("pattern"), str):
        budget["pattern repeats"] += _pattern_repeats(schema["pattern"])
    for keyword, sub, place in _subschemas(schema, where):
        _check_subschema(sub, place, budget, what, keywords, depth + 1, root)


def _subschemas(schema: dict, where: str):
    """(keyword, subschema, its place) for each subschema directly inside `schema`."""
    for keyword in _SUBSCHEMA:
        if isinstance(schema.get(keyword), dict):
            yield keyword, schema[keyword], f"{where}/{keyword}"
    for keyword in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield keyword, sub, f"{where}/{keyword}/{i}"
    for keyword in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                yield keyword, sub, f"{where}/{keyword}/{name}"


def _refuse(what: str, message: str) -> NoReturn:
    raise StructuredOutputError(f"{what}: {message}")


def _check_enforceable(schema: dict, where: str, what: str, root: Any) -> None:
    """What xgrammar ignores (_UNENFORCED_KEYWORDS, keywords beside $ref / anyOf / oneOf or without their type,
    uniqueItems, overlapping oneOf branches, lookarounds, a pattern beside length bounds, $refs other than JSON
    pointers) or enforces only in some uses (allOf of one schema, multipleOf on integers, `required` of listed
    properties), and patterns it would write as text that is not JSON."""
    for keyword in _UNENFORCED_KEYWORDS:
        if keyword in schema:
            _refuse(what, f"'{keyword}' (at {where}) cannot be enforced by structured output; remove it")
    if schema.get("uniqueItems") is True:
        _refuse(what, f"'uniqueItems' (at {where}) cannot be enforced by structured output; remove it")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        _refuse(what, f"'allOf' of {len(schema['allOf'])} schemas (at {where}) cannot be enforced by structured "
                      f"output; merge them into one schema")
    for keyword in ("$ref", "anyOf", "oneOf"):
        beside = sorted(set(schema) & _ASSERTIONS - {keyword}) if keyword in schema else []
        if keyword != "$ref" and "type" in beside and _types_cover(schema, keyword, root):
            beside.remove("type")  # it repeats what every branch says
        if beside:
            _refuse(what, f"'{beside[0]}' beside '{keyword}' (at {where}) cannot be enforced by structured output "
                          f"(only the {keyword} is); move it into the schema{'s' if keyword != '$ref' else ''} "
                          f"that {keyword} names")
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        _refuse(what, f"'$ref' {ref!r} (at {where}) is not a JSON pointer into the schema ('#/$defs/NAME'): "
                      f"anchors and other documents cannot be followed")
    if isinstance(schema.get("oneOf"), list) and not _disjoint(schema["oneOf"], root):
        _refuse(what, f"'oneOf' (at {where}) is enforced only as 'anyOf', and its schemas may overlap (a value "
                      f"could match two); use 'anyOf', or tell the schemas apart by type or by a required const "
                      f"property")
    _check_typed(schema, where, what)
    multiple = schema.get("multipleOf")
    integral = isinstance(multiple, int) or isinstance(multiple, float) and multiple.is_integer()
    if multiple is not None and not (schema.get("type") == "integer" and integral):
        _refuse(what, f"'multipleOf' (at {where}) cannot be enforced by structured output but as an integer "
                      f"multiple on type integer")
    required, listed = schema.get("required"), schema.get("properties")
    if isinstance(required, list) and "$ref" not in schema and "allOf" not in schema:  # those may list them
        missing = [name for name in required if not isinstance(listed, dict) or name not in listed]
        if missing:
            _refuse(what, f"'required' names {missing[0]!r} (at {where}), which is not in 'properties', so "
                          f"structured output cannot generate it")


def _check_typed(schema: dict, where: str, what: str) -> None:
    """Keywords of one type: counts, a type to read them by, patterns, an enum of that type."""
    for keyword in _COUNTS:
        value = schema.get(keyword)
        if keyword in schema and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            _refuse(what, f"'{keyword}' (at {where}) must be a non-negative integer, not {json.dumps(value)}")
    # a property name is a string whatever its schema says (xgrammar reads its keywords so)
    untyped = "type" not in schema and not where.endswith("/propertyNames")
    if untyped and not {"enum", "const", "$ref", "anyOf", "oneOf", "allOf"} & set(schema):
        typed = [keyword for keyword in _TYPED_KEYWORDS if keyword in schema]
        if typed:
            _refuse(what, f"'{typed[0]}' (at {where}) is enforced only with the type it applies to: add "
                          f"'\"type\": \"{'string' if typed[0] in _TYPED_KEYWORDS[:4] else 'number'}\"'")
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        if not _pattern_within_lengths(pattern, schema.get("minLength", 0), schema.get("maxLength")):
            _refuse(what, f"'pattern' with 'minLength' / 'maxLength' (at {where}): structured output enforces "
                          f"the pattern alone, and it allows other lengths; write the length into the pattern "
                          f"(e.g. '^[a-z]{{2,4}}$')")
        if "format" in schema:
            _refuse(what, f"'pattern' with 'format' (at {where}): structured output enforces one of them only; "
                          f"keep one")
        _check_pattern(pattern, where, what)
    elif isinstance(schema.get("format"), str) and _binding_lengths(schema):
        _refuse(what, f"'format' with 'minLength' / 'maxLength' (at {where}): structured output enforces the "
                      f"format alone; remove the length bounds (or the format)")
    if _integer_typed(schema):
        for keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = schema.get(keyword)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
                _refuse(what, f"'{keyword}' {value} (at {where}) is beyond the 64-bit integers structured output "
                              f"generates")
    if isinstance(schema.get("enum"), list) and isinstance(schema.get("type"), (str, list)):
        if not [v for v in schema["enum"] if _of_types(v, schema["type"])]:
            _refuse(what, f"no value of 'enum' (at {where}) is of its type {json.dumps(schema['type'])}")


def _pattern_within_lengths(pattern: str, min_length: Any, max_length: Any) -> bool:
    """Whether every text the pattern matches (whole: xgrammar anchors it) already has a length the bounds allow."""
    if not min_length and max_length is None:
        return True
    tree = _parse_pattern(pattern)
    if tree is None:
        return False
    from re import _constants  # noqa: PLC0415 - the stdlib's parser's own bound for an unbounded width

    shortest, longest = tree.getwidth()
    return (not isinstance(min_length, int) or shortest >= min_length) and (
        max_length is None or isinstance(max_length, int) and longest < _constants.MAXREPEAT and longest <= max_length)


def _binding_lengths(schema: dict) -> bool:
    """Whether a format's string has length bounds that can bind: every format's value is at least 1 long, and a
    maximum of 2048 or more (pydantic's HttpUrl: 2083) is far past what a format's value takes."""
    min_length, max_length = schema.get("minLength", 0), schema.get("maxLength")
    return (isinstance(min_length, int) and min_length > 1) or (isinstance(max_length, int) and max_length < 2048)


def _check_pattern(pattern: str, where: str, what: str) -> None:
    if _parse_pattern(pattern) is None and re.search(r"\\[pPc]|\(\?<?[=!]", pattern):
        _refuse(what, f"'pattern' {pattern!r} (at {where}) uses a Unicode property class (\\p), a control escape "
                      f"(\\c) or a lookaround, which structured output does not enforce")
    unsafe, lookaround = _pattern_risks(pattern)
    if lookaround:
        _refuse(what, f"'pattern' {pattern!r} (at {where}) has a lookahead or lookbehind, which structured output "
                      f"does not enforce")
    if unsafe:
        _refuse(what, f"'pattern' {pattern!r} (at {where}) can match '\"', '\\' or a control character, which a "
                      f"JSON string must escape: structured output would write them unescaped (not JSON); leave them "
                      f"out of its literals (a class of other characters too, as [ -~], is served without them)")


def _parse_pattern(pattern: str) -> Any:
    """The pattern's tree from Python's regex parser (ECMA's named groups read as Python's), None when Python cannot
    read it (xgrammar then judges it)."""
    from re import _parser  # noqa: PLC0415 - the stdlib's parser: the tree names every literal, range and assertion

    try:
        return _parser.parse(re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", pattern))
    except (re.error, RecursionError, OverflowError):
        return None


def _pattern_risks(pattern: str) -> tuple[bool, bool]:
    """(whether it can match a character JSON must escape, whether it has a lookaround). xgrammar leaves '"', '\\'
    and control characters out of a class that holds other characters too ([ -~] is served as printable ASCII
    but those two), but writes them unescaped where nothing else may stand: a literal, or a class of only them."""
    from re import _parser  # noqa: PLC0415

    tree = _parse_pattern(pattern)
    if tree is None:
        return False, False
    unsafe = lookaround = False
    stack = [tree]
    while stack:
        node = stack.pop()
        for op, arg in node:
            name = str(op)
            if name == "LITERAL" and arg in _MUST_ESCAPE:
                unsafe = True
            elif name == "IN" and not any(str(o) == "NEGATE" for o, _ in arg):
                unsafe |= all(str(o) == "LITERAL" and a in _MUST_ESCAPE or
                              str(o) == "RANGE" and all(c in _MUST_ESCAPE for c in range(a[0], a[1] + 1))
                              for o, a in arg)
            elif name in ("ASSERT", "ASSERT_NOT"):
                lookaround = True
            for value in (arg if isinstance(arg, (tuple, list)) else (arg,)):
                if isinstance(value, _parser.SubPattern):
                    stack.append(value)
                elif isinstance(value, list):  # a branch's alternatives
                    stack.extend(v for v in value if isinstance(v, _parser.SubPattern))
    return unsafe, lookaround


def _types_cover(schema: dict, keyword: str, root: Any) -> bool:
    """Whether `type` beside anyOf / oneOf admits every type each of its branches does (it then adds nothing)."""
    branches = [_types(b, root) for b in schema[keyword]] if isinstance(schema[keyword], list) else [None]
    return all(b is not None and all(_type_within(t, schema["type"]) for t in b) for b in branches)


def _type_within(kind: str, types: Any) -> bool:
    """Whether JSON type `kind` is among `types` (a "type" keyword's value: a name or a list); integers are numbers."""
    wanted = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    return kind in wanted or kind == "integer" and "number" in wanted


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _of_types(value: Any, types: str | list) -> bool:
    return _type_within(_json_type(value), types)


def _resolve(schema: Any, root: Any, hops: int = 0) -> Any:
    """The schema a local `$ref` names (followed up to 20 times), or the schema itself."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and hops < 20:
        ref, target = schema["$ref"], root
        if ref != "#" and not ref.startswith("#/"):
            return None
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        schema, hops = target, hops + 1
    return schema


def _types(schema: Any, root: Any, depth: int = 0) -> frozenset | None:
    """The JSON types a schema admits, when its keywords say so; None when it could be any."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or depth > 20:
        return None
    if "const" in schema:
        return frozenset((_json_type(schema["const"]),))
    if isinstance(schema.get("enum"), list):
        return frozenset(_json_type(v) for v in schema["enum"])
    if isinstance(schema.get("type"), str):
        return frozenset((schema["type"],))
    if isinstance(schema.get("type"), list):
        return frozenset(schema["type"])
    for keyword in ("anyOf", "oneOf"):
        if isinstance(schema.get(keyword), list):
            parts = [_types(s, root, depth + 1) for s in schema[keyword]]
            return None if any(p is None for p in parts) else frozenset().union(*parts)
    return None


def _tags(schema: Any, root: Any) -> dict[str, frozenset]:
    """Required properties held to constants (a discriminator): name -> the values it may take."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
        return {}
    tags = {}
    for name in schema.get("required") or ():
        prop = _resolve(schema["properties"].get(name), root)
        if isinstance(prop, dict) and ("const" in prop or isinstance(prop.get("enum"), list)):
            values = [prop["const"]] if "const" in prop else prop["enum"]
            tags[name] = frozenset(_comparable(v) for v in values)
    return tags


def _comparable(value: Any) -> str:
    """A JSON value as a key that equal values share (1 and 1.0 are one number to JSON Schema; true is not 1)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))
    return json.dumps(value, sort_keys=True)


def _emits_only_listed(schema: Any, root: Any) -> tuple[frozenset, frozenset] | None:
    """(its properties, the required ones) of an object schema whose values xgrammar writes with listed properties
    only (additionalProperties false, or absent: xgrammar's strict mode adds none), else None."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or _types(schema, root) != frozenset(("object",)):
        return None
    if schema.get("additionalProperties", False) is not False or schema.get("patternProperties"):
        return None
    listed = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    return frozenset(listed), frozenset(r for r in schema.get("required") or () if isinstance(r, str))


def _overlap(a: frozenset, b: frozenset) -> bool:
    widen = lambda types: types | {"number"} if "integer" in types else types  # noqa: E731 - integers are numbers
    return bool(widen(a) & widen(b))


def _disjoint(branches: list, root: Any) -> bool:
    """Whether no value the grammar writes can match two of `branches` (so anyOf serves oneOf exactly): told apart
    pairwise by their types, by a required property whose constants differ, or, for objects written with their
    listed properties only, by a property each requires that the other does not list."""
    objects = frozenset(("object",))
    info = [(_types(b, root), _tags(b, root), _emits_only_listed(b, root)) for b in branches]
    for i, (types_a, tags_a, shape_a) in enumerate(info):
        for types_b, tags_b, shape_b in info[i + 1:]:
            by_type = types_a is not None and types_b is not None and not _overlap(types_a, types_b)
            by_tag = types_a == types_b == objects and any(not tags_a[name] & tags_b[name]
                                                            for name in tags_a.keys() & tags_b.keys())
            # each requires a property the other never writes (pydantic's tags have defaults: not required)
            by_shape = shape_a is not None and shape_b is not None and bool(shape_a[1] - shape_b[0]) \
                and bool(shape_b[1] - shape_a[0])
            if not (by_type or by_tag or by_shape):
                return False
    return True


def _pattern_repeats(pattern: str) -> int:
    """The repetition counts ({n}, {n,}, {n,m}) written in a pattern, summed: a bound on what it costs."""
    return sum(max(int(low), int(high or 0)) for low, high in re.findall(r"\{(\d+)(?:,(\d*))?\}", pattern))


def served_schema(schema: Any, for_tools: bool = False) -> Any:
    """`schema` as xgrammar is given it (a copy; the same values allowed): an enum beside a type keeps the values
    of that type (xgrammar served the enum alone), an integer's fractional bounds round inward (xgrammar refused
    them). `for_tools`: a pattern that names a character JSON must escape is dropped (its string unconstrained),
    so a forced call's arguments stay JSON."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("enum"), list) and isinstance(node.get("type"), (str, list)):
            node["enum"] = [v for v in node["enum"] if _of_types(v, node["type"])] or node["enum"]
        if for_tools and isinstance(node.get("pattern"), str) and _pattern_risks(node["pattern"])[0]:
            del node["pattern"]
        if _integer_typed(node):
            _round_integer_bounds(node)
        stack.extend(sub for _, sub, _ in _subschemas(node, ""))
    return schema


def _integer_typed(schema: dict) -> bool:
    declared = schema.get("type")
    return declared == "integer" or isinstance(declared, list) and "integer" in declared and "number" not in declared


def _round_integer_bounds(node: dict) -> None:
    for keyword, inward, exclusive in (("minimum", math.ceil, False), ("maximum", math.floor, False),
                                       ("exclusiveMinimum", lambda x: math.floor(x) + 1, True),
                                       ("exclusiveMaximum", lambda x: math.ceil(x) - 1, True)):
        value = node.get(keyword)
        if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
            del node[keyword]
            bound = "minimum" if keyword.endswith("inimum") else "maximum"
            rounded = inward(value)
            node[bound] = rounded if bound not in node else (max if bound == "minimum" else min)(node[bound], rounded)
        elif exclusive and isinstance(value, float) and value.is_integer():
            node[keyword] = int(value)
