"""Twenty function schemas written for the agents tests (issue 43): plain and MCP-style tools with
`$ref`/`$defs`, optional arguments, enums, nested objects, arrays, bounded numbers, anyOf, type
lists, no parameters at all. As OpenAI-shaped tool dicts, in TOOLS."""

from __future__ import annotations

_S = {"type": "string"}
_I = {"type": "integer"}

FUNCTIONS: dict[str, dict] = {
    "get_weather": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 24}, "units": {"enum": ["celsius", "fahrenheit"]}}},
    "add": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    "set_volume": {"type": "object", "required": ["level"], "additionalProperties": False,
                   "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 11}}},
    "ping": {"type": "object", "properties": {}},
    "no_params": {"type": "object"},
    "search_web": {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "string", "maxLength": 40}, "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
        "safe": {"type": "boolean"}}},
    "create_event": {"type": "object", "required": ["title", "when"], "additionalProperties": False, "properties": {
        "title": {"type": "string", "maxLength": 30},
        "when": {"type": "object", "required": ["day", "hour"], "additionalProperties": False, "properties": {
            "day": {"type": "integer", "minimum": 1, "maximum": 31}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}}},
        "attendees": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}},
    "tag_items": {"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"enum": ["red", "green", "blue"]}}}},
    "mcp_read_file": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "required": ["path"],
                      "additionalProperties": False, "properties": {
                          "path": {"type": "string", "description": "file path", "maxLength": 40},
                          "encoding": {"type": "string", "enum": ["utf-8", "latin-1"], "default": "utf-8"}}},
    "mcp_query_db": {"type": "object", "required": ["filter"], "$defs": {
        "cond": {"type": "object", "required": ["field", "op", "value"], "additionalProperties": False, "properties": {
            "field": {"type": "string", "maxLength": 10}, "op": {"enum": ["eq", "lt", "gt"]},
            "value": {"type": ["integer", "string"], "maxLength": 8}}}},
        "properties": {"filter": {"type": "array", "maxItems": 3, "items": {"$ref": "#/$defs/cond"}},
                       "limit": {"type": "integer", "minimum": 1, "maximum": 100}}},
    "mcp_tree": {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "required": ["name"],
                                                            "additionalProperties": False, "properties": {
        "name": {"type": "string", "maxLength": 8},
        "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}}}}},
    "mcp_send_email": {"type": "object", "required": ["to", "subject"], "definitions": {
        "addr": {"type": "string", "maxLength": 20}}, "properties": {
        "to": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"$ref": "#/definitions/addr"}},
        "subject": {"type": "string", "maxLength": 20}, "cc": {"$ref": "#/definitions/addr"},
        "priority": {"enum": ["low", "normal", "high"]}}},
    "convert": {"type": "object", "required": ["amount", "from", "to"], "additionalProperties": False, "properties": {
        "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
        "from": {"enum": ["USD", "EUR", "JPY"]}, "to": {"enum": ["USD", "EUR", "JPY"]}}},
    "rate": {"type": "object", "required": ["score"], "additionalProperties": False, "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1}, "comment": {"type": ["string", "null"], "maxLength": 16}}},
    "move": {"type": "object", "required": ["to"], "additionalProperties": False, "properties": {
        "to": {"anyOf": [{"type": "object", "required": ["x", "y"], "additionalProperties": False,
                          "properties": {"x": _I, "y": _I}}, {"enum": ["home", "origin"]}]}}},
    "batch_ids": {"type": "object", "required": ["ids"], "additionalProperties": False, "properties": {
        "ids": {"type": "array", "maxItems": 5, "items": {"type": "integer", "minimum": 1, "maximum": 999}}}},
    "lookup": {"type": "object", "required": ["key"], "properties": {"key": {"type": "string", "pattern": "^[a-z]{2,6}$"}}},
    "schedule": {"type": "object", "required": ["date"], "additionalProperties": False, "properties": {
        "date": {"type": "string", "format": "date"}, "remind": {"type": "boolean"}}},
    "translate": {"type": "object", "required": ["text", "target"], "properties": {
        "text": {"type": "string", "maxLength": 30}, "target": {"type": "string", "enum": ["fr", "de", "ja"]},
        "formal": {"type": "boolean"}, "glossary": {"type": "object", "additionalProperties": _S, "maxProperties": 2}}},
    "mcp_run": {"type": "object", "required": ["command"], "$defs": {
        "env": {"type": "object", "required": ["name", "value"], "additionalProperties": False,
                "properties": {"name": {"type": "string", "maxLength": 8}, "value": {"type": "string", "maxLength": 8}}}},
        "properties": {"command": {"type": "string", "maxLength": 20}, "timeout": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 60},
                       "env": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/env"}}}},
}

TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": p}}
         for n, p in FUNCTIONS.items()]
