"""Structured outputs: what a constraint (common_pb2.StructuredOutput) is as an llguidance grammar, and
its check.

Every layer that takes a constraint shares this: the gateway checks it (a 400 naming the parameter, before
any work), the scheduler compiles the same grammar text against the model's tokenizer
(scheduler_svc/structured_output.py), the offline LLM builds the proto from vLLM's
StructuredOutputsParams. llguidance is torch-free, so the gateway and the scheduler may import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from pagedserve.errors import InvalidRequestError
from pagedserve.v1 import common_pb2

# The text of a schema, regex or grammar, in characters (it is parsed and compiled per request, cached).
MAX_SPEC_CHARS = 64 * 1024
# Strings of a choice constraint, and characters each.
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024

# What compiling a grammar and computing one mask may spend (llguidance's fuel and size bounds), so that no
# schema or grammar a client sends can hold a compile or a step for long; beyond them the request fails.
PARSER_LIMITS = dict(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=250_000,
    max_grammar_size=200_000,
)


# JSON is written compactly (no whitespace between tokens): with whitespace allowed anywhere, a sampled model
# can fill the whole of max_tokens with newlines and spaces before it closes the object.
JSON_OPTIONS = {"whitespace_flexible": False}


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)


@dataclass(frozen=True, slots=True)
class Constraint:
    """A structured-output constraint in the form a client library spells it (vLLM's StructuredOutputsParams
    names): set exactly one field."""

    # A JSON schema (a dict, or its JSON text).
    json: dict | str | None = None
    # A regular expression the whole output matches.
    regex: str | None = None
    # The output is one of these strings.
    choice: list[str] | None = None
    # A Lark (or GBNF / EBNF) grammar.
    grammar: str | None = None
    # Any JSON object.
    json_object: bool | None = None

    def to_proto(self, param: str = "structured_outputs") -> common_pb2.StructuredOutput | None:
        """The proto, None when no field is set; InvalidRequestError naming param when more than one is."""
        given = [
            name for name in ("json", "regex", "choice", "grammar", "json_object") if _is_set(self, name)
        ]
        if not given:
            return None
        if len(given) > 1:
            raise InvalidRequestError(
                f"{param} takes one constraint, got {len(given)}: {', '.join(given)}", param
            )
        so = common_pb2.StructuredOutput()
        if self.json is not None:
            so.json_schema = schema_text(self.json, param)
        elif self.regex is not None:
            so.regex = _text(self.regex, param)
        elif self.choice is not None:
            if not isinstance(self.choice, list) or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError(f"{param}: choice must be a list of strings", param)
            so.choice.SetInParent()  # an empty list is still a (refused) choice constraint
            so.choice.choices.extend(self.choice)
        elif self.grammar is not None:
            so.grammar = _text(self.grammar, param)
        else:
            so.json_object = True
        return so


def _is_set(c: Constraint, name: str) -> bool:
    value = getattr(c, name)
    return bool(value) if name == "json_object" else value is not None


def _text(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param} must be a string", param)
    return value


def schema_text(schema: object, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text; it must be a JSON object or a bool."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as error:
            raise InvalidRequestError(f"{param}: the schema is not valid JSON: {error}", param) from None
        text = schema
    else:
        parsed, text = schema, json.dumps(schema)
    if not isinstance(parsed, dict | bool):
        raise InvalidRequestError(f"{param}: the schema must be a JSON object", param)
    return text


def kind_of(so: common_pb2.StructuredOutput) -> str | None:
    """Which constraint is set ("json_schema", "json_object", "regex", "choice", "grammar"), or None."""
    return so.WhichOneof("kind")


def check_shape(so: common_pb2.StructuredOutput, param: str) -> None:
    """The cheap checks (sizes, an empty choice list), before anything is parsed."""
    kind = kind_of(so)
    if kind is None:
        return
    if kind == "json_object" and not so.json_object:
        raise InvalidRequestError(f"{param}: json_object must be true when set", param)
    if kind == "choice":
        choices = so.choice.choices
        if not choices:
            raise InvalidRequestError(f"{param}: the choice list is empty", param)
        if len(choices) > MAX_CHOICES:
            raise InvalidRequestError(f"{param}: at most {MAX_CHOICES} choices, got {len(choices)}", param)
        if any(len(c) > MAX_CHOICE_CHARS for c in choices):
            raise InvalidRequestError(
                f"{param}: a choice may be at most {MAX_CHOICE_CHARS} characters", param
            )
        if any(not c for c in choices):
            raise InvalidRequestError(f"{param}: choices must not be empty strings", param)
    elif kind != "json_object":
        text = getattr(so, kind)
        if not text:
            raise InvalidRequestError(f"{param}: the {kind.replace('_', ' ')} is empty", param)
        if len(text) > MAX_SPEC_CHARS:
            raise InvalidRequestError(
                f"{param}: the {kind.replace('_', ' ')} may be at most {MAX_SPEC_CHARS} characters", param
            )


def grammar_text(so: common_pb2.StructuredOutput, param: str = "structured_output") -> str:
    """The llguidance grammar of a constraint (check_shape passed); InvalidRequestError if it cannot be
    read at all (a schema that is not JSON, a GBNF grammar that does not convert)."""
    kind = kind_of(so)
    try:
        if kind == "json_schema":
            schema_text(so.json_schema, param)
            return llguidance.LLMatcher.grammar_from_json_schema(so.json_schema, overrides=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(so.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(so.choice.choices))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", so.grammar)
    except ValueError as error:
        raise InvalidRequestError(f"{param}: {error}", param) from None
    raise AssertionError(f"unknown structured output kind {kind!r}")


def check_structured_output(so: common_pb2.StructuredOutput, param: str = "structured_output") -> None:
    """Refuse a constraint that does not compile (an invalid schema, an unsupported keyword, a regex or
    grammar with a syntax error), naming param. Bounded by PARSER_LIMITS, without the tokenizer."""
    if kind_of(so) is None:
        return
    check_shape(so, param)
    grammar = grammar_text(so, param)
    error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if error:
        raise InvalidRequestError(f"{param}: {one_line(error)}", param)


def one_line(message: str, max_chars: int = 400) -> str:
    """llguidance's multi-line error (with a caret under the spot) as one line for a client's error."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())[:max_chars]
