"""The gateway's tokenizer: loaded without model code where the folder allows it, and the very tokenizer
transformers' AutoTokenizer gives (same ids for every dev prompt, plain and through the chat template)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from services.config import get_settings
from services.models.locate import resolve_model_dir
from services.models.tokenization import encode_messages, encode_prompt
from services.models.tokenizer_loading import DIRECT_CLASS, load_tokenizer, loads_directly, max_context
from tests.conftest import REPO_ROOT, load_dev_prompts

BUILTIN = "smollm2-135m"


@pytest.fixture(scope="module")
def builtin_dir() -> str:
    return resolve_model_dir(BUILTIN, get_settings().cache_dir)[1]


def test_the_direct_tokenizer_is_the_one_auto_tokenizer_gives(builtin_dir):
    from transformers import AutoTokenizer

    assert loads_directly(builtin_dir)
    direct, auto = load_tokenizer(builtin_dir), AutoTokenizer.from_pretrained(builtin_dir, local_files_only=True)
    assert type(direct) is type(auto) and len(direct) == len(auto)
    assert direct.all_special_ids == auto.all_special_ids and direct.eos_token_id == auto.eos_token_id
    chats = [[{"role": "user", "content": row["prompt"]}] for row in load_dev_prompts()]
    chats.append([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi there"},
                  {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "Ça va ?"}])
    for chat in chats:
        text = chat[-1]["content"]
        assert encode_prompt(direct, text, chat=False) == encode_prompt(auto, text, chat=False)
        ids = encode_messages(direct, chat)
        assert ids == encode_messages(auto, chat), chat
        assert direct.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)


def _copy_tokenizer(source: str, dest, **config_changes) -> str:
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), dest / name)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (dest / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return str(dest)


def test_only_a_folder_saved_with_the_generic_class_and_no_custom_code_loads_directly(builtin_dir, tmp_path):
    assert json.loads(open(os.path.join(builtin_dir, "tokenizer_config.json")).read())["tokenizer_class"] \
        == DIRECT_CLASS
    assert not loads_directly(_copy_tokenizer(builtin_dir, tmp_path / "gpt2", tokenizer_class="GPT2Tokenizer"))
    assert not loads_directly(_copy_tokenizer(builtin_dir, tmp_path / "none", tokenizer_class=None))
    assert not loads_directly(_copy_tokenizer(builtin_dir, tmp_path / "remote",
                                              auto_map={"AutoTokenizer": [None, "tok.MyTokenizer"]}))
    no_json = _copy_tokenizer(builtin_dir, tmp_path / "no-json")
    os.remove(os.path.join(no_json, "tokenizer.json"))
    assert not loads_directly(no_json)
    assert not loads_directly(str(tmp_path / "missing")) and not loads_directly("HuggingFaceTB/SmolLM2-135M")
    assert loads_directly(_copy_tokenizer(builtin_dir, tmp_path / "same"))


def test_the_context_window_comes_from_the_config_or_from_transformers_names_for_it(builtin_dir, tmp_path):
    from transformers import AutoConfig

    assert max_context(builtin_dir) == AutoConfig.from_pretrained(builtin_dir).max_position_embeddings == 8192
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 1536}))
    assert max_context(str(tmp_path)) == 1536  # GPT-2 names it n_positions: transformers' config maps it


SERVED = """
import json, sys
from gateway.state import load_served_model
from services.config import Settings
model = load_served_model(Settings(target=sys.argv[1]))
ids = model.tokenizer.encode("Hello there")
print(json.dumps({"max_context": model.max_context, "vocab": len(model.tokenizer), "ids": ids,
                  "loaded": sorted({"torch", "transformers.configuration_utils"} & set(sys.modules))}))
"""


@pytest.mark.parametrize("target", [BUILTIN, "random:tiny"])
def test_the_gateway_loads_its_model_without_model_code(builtin_dir, target):
    """The gateway serves the built-in model and random targets without importing torch or transformers'
    config classes (which import torch): seconds and hundreds of MB in a process that runs no model."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", SERVED, target], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    served = json.loads(done.stdout.strip().splitlines()[-1])
    assert served["loaded"] == [], served
    assert served["ids"] and served["vocab"] == (49152 if target == BUILTIN else 512)
    assert served["max_context"] == (8192 if target == BUILTIN else 4096)
