"""data/extraction.jsonl: every record whole, its schema servable and its reference answer valid against it."""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import llguidance
import pytest

from services.bench.prompts import EXTRACTION_PATH, load_prompts
from services.speculative.grammar import json_schema_grammar

FIELDS = {"id", "category", "prompt", "schema", "context_chars", "answer", "source"}
RECORDS = [json.loads(line) for line in EXTRACTION_PATH.read_text().splitlines() if line.strip()]


def test_the_set_has_at_least_32_records_with_unique_ids():
    assert len(RECORDS) >= 32
    ids = [record["id"] for record in RECORDS]
    assert len(set(ids)) == len(ids), [name for name, count in Counter(ids).items() if count > 1]


@pytest.mark.parametrize("record", RECORDS, ids=[record["id"] for record in RECORDS])
def test_a_record_is_whole_and_its_schema_compiles(record):
    assert set(record) == FIELDS
    assert record["category"] == "extraction"
    assert 300 <= record["context_chars"] <= 1200
    instruction, document = record["prompt"].split("\n\n", 1)  # the instruction, then the document
    assert len(document) == record["context_chars"] and instruction
    schema = record["schema"]
    jsonschema.Draft202012Validator.check_schema(schema)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(json_schema_grammar(schema), None)
    assert not is_error and not messages, messages  # the engine serves every keyword (no warning either)
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert 3 <= len(schema["properties"]) <= 8 and schema["required"] == list(schema["properties"])
    jsonschema.validate(record["answer"], schema)  # the answer the author reads in the document fits


def test_schemas_vary_and_one_is_shared_by_a_few_records():
    uses = Counter(json.dumps(record["schema"], sort_keys=True) for record in RECORDS)
    assert sorted(uses.values())[-1] in (4, 5)  # one schema repeated, as requests to one endpoint would
    assert len(uses) >= len(RECORDS) - 5


def test_the_bench_reads_each_record_with_its_schema():
    prompts = load_prompts(EXTRACTION_PATH)
    assert [prompt.id for prompt in prompts] == [record["id"] for record in RECORDS]
    assert all(prompt.schema == record["schema"] and prompt.group == "grounded"
               for prompt, record in zip(prompts, RECORDS))
