"""The JSON schemas of the structured-output benchmarks (bench_structured.py, bench_grammar_libs.py),
with one valid instance of each: nested objects, bounded arrays, a pattern, `$ref`, `anyOf`. Plain
data, so a script that runs without llmserve installed can import it too."""

SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
     "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}}},
    {"type": "object", "additionalProperties": False, "required": ["name", "tags", "address"],
     "properties": {"name": {"type": "string", "maxLength": 40}, "tags": {"type": "array", "items": {"type": "string"},
                    "maxItems": 5},
                    "address": {"type": "object", "additionalProperties": False, "required": ["street", "zip"],
                                "properties": {"street": {"type": "string"}, "zip": {"type": "string",
                                               "pattern": "^[0-9]{5}$"}}}}},
    {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
     "properties": {"answer": {"enum": ["yes", "no", "unsure"]}, "confidence": {"type": "number"}}},
    {"$defs": {"person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}},
     "type": "object", "additionalProperties": False, "required": ["people"],
     "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 4}}},
    {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"const": True}}},
               {"type": "object", "additionalProperties": False, "required": ["error"],
                "properties": {"error": {"type": "string"}}}]},
]  # fmt: skip
# one valid instance per schema, in the same order
INSTANCES = [
    {"city": "Paris", "country": "France", "population": 2102650},
    {"name": "Ada Lovelace", "tags": ["math", "poetry", "engines"],
     "address": {"street": "12 St James's Square", "zip": "10115"}},
    {"answer": "unsure", "confidence": 0.75},
    {"people": [{"name": "Ann", "age": 31}, {"name": "Bob", "age": 42}]},
    {"error": "upstream timed out after 30 s"},
]  # fmt: skip
