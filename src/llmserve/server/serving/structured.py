"""Structured-output fields of a request → `StructuredOutputsParams`.

Three spellings reach the same constraint: OpenAI's `response_format` (`json_object`, or
`json_schema` with a schema), vLLM's `structured_outputs` object, and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. A request may use one of them; two at once is a
400, as is a constraint that does not parse (named by its field). Whether a schema, regex or
grammar is valid is decided by the engine when the prompt is processed (also a 400).
"""

from __future__ import annotations

from llmserve.errors import ParameterError
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.server.errors import APIError
from llmserve.server.protocol import _SamplingFields


def structured_outputs(req: _SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came in (or None, None); APIError 400 naming the
    field when it is malformed."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    field = "response_format"  # the field being read, named when it does not parse
    try:
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
            if schema is None:
                raise ParameterError(
                    "response_format json_schema needs json_schema.schema (a JSON schema object)",
                    param="response_format",
                )
            found.append(("response_format", StructuredOutputsParams(json=schema)))
        field, so = "structured_outputs", req.structured_outputs
        if so is not None:
            found.append(
                ("structured_outputs", StructuredOutputsParams(
                    json=so.json_, json_object=bool(so.json_object), regex=so.regex, choice=so.choice,
                    grammar=so.grammar,
                ))
            )  # fmt: skip
        for name, kwargs in (
            ("guided_json", {"json": req.guided_json}),
            ("guided_regex", {"regex": req.guided_regex}),
            ("guided_choice", {"choice": req.guided_choice}),
            ("guided_grammar", {"grammar": req.guided_grammar}),
        ):
            field = name
            if next(iter(kwargs.values())) is not None:
                found.append((name, StructuredOutputsParams(**kwargs)))  # type: ignore[arg-type]
    except ParameterError as e:
        raise APIError(400, str(e), param=field) from None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"give one structured-output constraint; got {names}", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)
