"""llama.cpp drafts on the built-in model's own GGUF (Q4_1): lossless, KV trimmed, batched, vocabulary checked."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from scipy.stats import chisquare

from services.config import LlamaCppSettings
from services.engine import GenerationOptions, generate
from services.errors import ModelNotFoundError, TokenizerMismatchError
from services.models.drafters import load_draft_source
from services.models.drafters.batched import DraftCall, EngineDrafter, propose_many
from services.models.drafters.factory import resolve_draft_spec
from services.models.drafters.gguf import gguf_path, load_gguf_engine
from services.models.llamacpp import LlamaCppEngine
from services.models.loading import TargetVocab, load_model, load_target_vocab
from services.models.tokenization import encode_prompt
from services.speculative.params import SamplingParams
from services.speculative.sampling import warp_logits
from services.speculative.verification import rejection_sample
from tests.conftest import WORDS, save_tiny_model

pytestmark = pytest.mark.slow

SPEC = "gguf:smollm2-135m"
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def vocab() -> TargetVocab:
    return load_target_vocab("smollm2-135m")


@pytest.fixture(scope="module")
def gguf_source(builtin_target):
    return load_draft_source(SPEC, builtin_target, num_threads=1)


def prompt_ids(tokenizer, text: str) -> list[int]:
    return encode_prompt(tokenizer, text, chat=True)


def test_greedy_sd_with_llama_cpp_drafts_is_target_only(builtin_target, gguf_source, dev_prompts):
    hybrid = load_draft_source(f"hybrid:{SPEC}", builtin_target, num_threads=1)
    assert load_draft_source("auto", builtin_target, num_threads=1).spec == f"suffix:{SPEC}"
    none = load_draft_source("none", builtin_target)
    picked = [p for p in dev_prompts if p["context_chars"] == 0][:2] + \
        sorted((p for p in dev_prompts if p["context_chars"] > 0), key=lambda p: len(p["prompt"]))[:2]
    accepted = 0
    for record in picked:
        ids = prompt_ids(builtin_target.tokenizer, record["prompt"])
        expected = generate(builtin_target, none, ids, GenerationOptions(max_new_tokens=32))
        for source in (gguf_source, hybrid):
            result = generate(builtin_target, source, ids, GenerationOptions(max_new_tokens=32))
            assert result.token_ids == expected.token_ids, f"{source.spec} differs on {record['id']}"
            accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_kv_is_trimmed_to_the_agreed_prefix_not_evaluated_again(vocab):
    draft_engine = load_gguf_engine(SPEC, vocab, LlamaCppSettings(num_sequences=2), num_threads=1)
    engine: LlamaCppEngine = draft_engine.engine
    drafter = draft_engine.new_drafter()
    context = prompt_ids(vocab.tokenizer, "Name three rivers in Europe.")
    first = drafter.propose(context, 4, GREEDY, None)
    assert first.num_draft_tokens == 4
    assert engine.num_decoded_tokens == len(context) + 3  # the prompt, then one token per draft step
    # the verdict kept two draft tokens and added one of the target's: only that token and the new block's
    # steps are evaluated, the prompt and the kept tokens stay in the KV
    before = engine.num_decoded_tokens
    recovered = 11 if first.token_ids[2] != 11 else 12
    agreed = [*context, *first.token_ids[:2], recovered]
    second = drafter.propose(agreed, 4, GREEDY, None)
    assert engine.num_decoded_tokens - before == 1 + 3  # the recovered token, then one per draft step
    assert drafter.sequence.length == len(agreed) + 3
    fresh = draft_engine.new_drafter().propose(agreed, 4, GREEDY, None)
    assert second.token_ids == fresh.token_ids


def test_sessions_step_together_and_evicted_slots_give_the_same_blocks(vocab):
    draft_engine = load_gguf_engine(SPEC, vocab, LlamaCppSettings(num_sequences=3), num_threads=1)
    texts = ["What is 2 + 2?", "Write a short poem about snow.", "List three colours.", "Say hello in French."]
    contexts = [prompt_ids(vocab.tokenizer, text) for text in texts]
    alone = []
    for context in contexts:
        drafter = draft_engine.new_drafter()
        alone.append(drafter.propose(context, 5, GREEDY, None).token_ids)
        drafter.release()
    drafters = [draft_engine.new_drafter() for _ in texts]
    assert all(isinstance(drafter, EngineDrafter) for drafter in drafters)
    # three slots, four sessions: two steps of three, the fourth session takes the idle one's slot
    for group in ([0, 1, 2], [3, 1, 2], [0, 3]):
        calls = [DraftCall(drafters[index], contexts[index], 5, GREEDY, None) for index in group]
        for index, proposal in zip(group, propose_many(calls)):
            assert proposal.token_ids == alone[index]
    assert draft_engine.engine.num_evictions >= 2


def test_sampled_llama_cpp_drafts_keep_rejection_sampling_exact(builtin_target, gguf_source):
    """The draft's proposals come with the probabilities they were drawn from: the first committed token
    follows the warped target distribution (chi-square), whatever the draft proposes."""
    sampling = SamplingParams(temperature=1.5, top_k=6, seed=1)
    context = prompt_ids(builtin_target.tokenizer, "Pick a random fruit and name it.")
    with torch.no_grad():
        logits = builtin_target.model(torch.tensor([context])).logits[0, -1:].float()  # [1, vocab]
    target_probs = warp_logits(logits, sampling)  # [1, vocab]
    drafter = gguf_source.new_drafter()
    num_trials = 600
    counts = torch.zeros(target_probs.shape[-1])
    drafted = set()
    generator = torch.Generator().manual_seed(4)
    for trial in range(num_trials):
        proposal = drafter.propose(context, 1, sampling, sampling.make_stream("draft", trial))
        assert proposal.probs is not None and proposal.probs.shape == (1, target_probs.shape[-1])
        assert proposal.probs[0, proposal.token_ids[0]] > 0
        drafted.add(proposal.token_ids[0])
        bonus_probs = target_probs  # the bonus row is not reached by the first token's distribution
        verdict = rejection_sample(torch.tensor(proposal.token_ids), proposal.probs,
                                   torch.cat([target_probs, bonus_probs]), generator)
        first = proposal.token_ids[0] if verdict.num_accepted else verdict.next_token_id
        counts[first] += 1
    support = target_probs[0] > 0
    assert counts[~support].sum() == 0
    assert len(drafted) > 1, "a sampled draft proposes more than one token"
    expected = target_probs[0] * num_trials
    common = support & (expected >= 5)  # chi-square wants 5 expected per bin: the rare tokens share one
    observed = [*counts[common].tolist(), float(counts[support & ~common].sum())]
    wanted = [*expected[common].tolist(), float(expected[support & ~common].sum())]
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    assert len(wanted) >= 2
    wanted = [value * num_trials / sum(wanted) for value in wanted]  # float32 probs: exact totals for scipy
    assert chisquare(observed, wanted).pvalue > 1e-3


def test_contexts_past_the_slot_propose_nothing(vocab):
    draft_engine = load_gguf_engine(SPEC, vocab, LlamaCppSettings(num_sequences=1, context_tokens=64),
                                    num_threads=1)
    room = draft_engine.max_context  # llama.cpp rounds the context up (to 256 here)
    assert 64 <= room == draft_engine.engine.context_tokens
    drafter = draft_engine.new_drafter()
    context = [100 + index % 50 for index in range(room)]
    assert drafter.propose(context[:-3], 3, GREEDY, None).num_draft_tokens == 3
    assert drafter.propose(context[:-1], 3, GREEDY, None).num_draft_tokens == 1
    assert drafter.propose(context, 3, GREEDY, None).token_ids == []


def test_a_gguf_of_another_vocabulary_is_refused_naming_both(tmp_path, vocab):
    save_tiny_model(tmp_path / "tiny", seed=0, words=WORDS)
    tiny = load_model(str(tmp_path / "tiny"))
    with pytest.raises(TokenizerMismatchError, match=r"gguf:smollm2-135m.*vocab size 49152.*tiny.*vocab size 64"):
        load_draft_source(SPEC, tiny)
    renamed = {**vocab.tokenizer.get_vocab()}
    swapped = TargetVocab("other-target", _FakeTokenizer({text: index for text, index in renamed.items()
                                                          if index != 5} | {"<swapped>": 5}), vocab.vocab_size)
    with pytest.raises(TokenizerMismatchError, match=r"token 5 is .* in the draft and '<swapped>' in the target"):
        load_draft_source(SPEC, swapped)


class _FakeTokenizer:
    def __init__(self, table: dict[str, int]) -> None:
        self.table = table

    def get_vocab(self) -> dict[str, int]:
        return self.table


def test_bad_gguf_specs_name_the_value(vocab):
    with pytest.raises(ModelNotFoundError, match="no GGUF file at '/nowhere/x.gguf'"):
        load_draft_source("gguf:/nowhere/x.gguf", vocab)
    assert gguf_path(SPEC).name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_without_llama_cpp_the_draft_says_what_to_install_and_auto_uses_suffix_drafts():
    script = (
        "import sys; sys.modules['llama_cpp'] = None\n"
        "from services.models.drafters.factory import resolve_draft_spec\n"
        "from services.models.drafters import load_draft_source\n"
        "from services.models.loading import load_target_vocab\n"
        "print(resolve_draft_spec('auto', 'smollm2-135m'))\n"
        "try:\n"
        "    load_draft_source('gguf:smollm2-135m', load_target_vocab('smollm2-135m'))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "suffix", done.stderr
    assert lines[1].startswith("LlamaCppMissingError") and "`mirror-sd llamacpp build` builds llama-cpp-python==0.3.36" in lines[1]
    assert resolve_draft_spec("auto", "smollm2-135m") == "suffix:gguf:smollm2-135m"
    assert resolve_draft_spec("auto", "SmolLM2-135M-Instruct") == "suffix:gguf:smollm2-135m"
    assert resolve_draft_spec("auto", "/some/other/model") == "suffix"
