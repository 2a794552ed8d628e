"""A small draft built on the target: its embeddings, a few decoder layers of its own, and its output
head restricted to the tokens it emits most (a trimmed head).

Only the draft's own layers and final norm are stored (a few MB); the
embeddings and head rows come from the target at load time, so the draft
shares the target's tokenizer by construction. Logits come back over the
full vocabulary (-inf outside the kept tokens), so every drafter, sampler
and verifier treats it like any causal LM.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from services.errors import ModelNotFoundError
from services.models.loading import LoadedModel

logger = logging.getLogger(__name__)

CONFIG_FILE = "draft_config.json"
WEIGHTS_FILE = "draft.safetensors"
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent / "default_draft"


class TrimmedDraft(nn.Module):
    def __init__(self, target: nn.Module, *, num_layers: int, keep_ids: torch.Tensor,
                 init_from_layers: list[int] | None = None) -> None:
        super().__init__()
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = list(config.layer_types)[:num_layers]
        self.config = config
        self.vocab_size = int(config.vocab_size)
        self.body = LlamaModel(config)
        self.body.embed_tokens = target.get_input_embeddings()  # shared with the target, frozen
        self.body.embed_tokens.weight.requires_grad_(False)
        head_rows = target.get_output_embeddings().weight.detach()[keep_ids]  # [keep, hidden]
        self.head = nn.Linear(config.hidden_size, len(keep_ids), bias=False)
        self.head.weight = nn.Parameter(head_rows.clone(), requires_grad=False)
        self.register_buffer("keep_ids", keep_ids.clone(), persistent=False)
        if init_from_layers:
            source_layers = target.model.layers
            for index, source in enumerate(init_from_layers):
                self.body.layers[index].load_state_dict(source_layers[source].state_dict())
            self.body.norm.load_state_dict(target.model.norm.state_dict())

    def trimmed_logits(self, input_ids: torch.Tensor, cache=None, use_cache: bool = False) -> tuple:
        """[batch, seq, keep] logits over the kept tokens (training), plus the body's output."""
        output = self.body(input_ids=input_ids, cache=cache, use_cache=use_cache)
        return self.head(output.last_hidden_state), output

    def forward(self, input_ids: torch.Tensor, cache=None, use_cache: bool = True, logits_to_keep: int = 0,
                **_: object) -> CausalLMOutputWithPast:
        output = self.body(input_ids=input_ids, cache=cache, use_cache=use_cache)
        hidden = output.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.full_logits(hidden))  # the cache passed in was updated in place

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab]: the kept tokens' logits, -inf for every other token."""
        small = self.head(hidden)  # [..., keep]
        logits = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        logits.index_copy_(-1, self.keep_ids, small)
        return logits

    def decoder_parts(self):
        """The layers for the packed forward (services/models/decoder.py), with the trimmed head."""
        from services.models.decoder import DecoderParts

        config, body = self.config, self.body
        return DecoderParts(
            embed=body.embed_tokens, layers=body.layers, norm=body.norm, rotary=body.rotary_emb,
            head=self.full_logits, num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    def own_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores: the draft's layers and norm (not the target's embeddings/head)."""
        return {f"body.{name}": tensor for name, tensor in self.body.state_dict().items()
                if not name.startswith("embed_tokens")}


def save_trimmed_draft(draft: TrimmedDraft, directory: Path, *, meta: dict, dtype: torch.dtype = torch.bfloat16) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(dtype).contiguous() for name, tensor in draft.own_state().items()}
    save_file(state, str(directory / WEIGHTS_FILE))
    config = {"format": "mirror-sd-trimmed-draft/1", "num_layers": draft.config.num_hidden_layers,
              "keep_ids": draft.keep_ids.tolist(), "target_vocab_size": draft.vocab_size,
              "target_hidden_size": draft.config.hidden_size, **meta}
    (directory / CONFIG_FILE).write_text(json.dumps(config))


def is_trimmed_draft_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def load_trimmed_draft(directory: Path, target: LoadedModel, *, name: str | None = None) -> LoadedModel:
    if not is_trimmed_draft_dir(directory):
        raise ModelNotFoundError(f"{str(directory)!r} holds no trimmed draft ({CONFIG_FILE} + {WEIGHTS_FILE})")
    config = json.loads((directory / CONFIG_FILE).read_text())
    if (config["target_vocab_size"], config["target_hidden_size"]) != (target.vocab_size,
                                                                         int(target.config.hidden_size)):
        raise ModelNotFoundError(
            f"draft {str(directory)!r} was trained for a target with vocab {config['target_vocab_size']} and "
            f"width {config['target_hidden_size']}; {target.name!r} has {target.vocab_size} and "
            f"{target.config.hidden_size}")
    keep_ids = torch.tensor(config["keep_ids"], dtype=torch.long)
    draft = TrimmedDraft(target.model, num_layers=int(config["num_layers"]), keep_ids=keep_ids)
    state = {key: value.float() for key, value in load_file(str(directory / WEIGHTS_FILE)).items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [key for key in missing if not key.startswith(("body.embed_tokens", "head."))]
    if missing or unexpected:
        raise ModelNotFoundError(f"draft {str(directory)!r}: missing {missing}, unexpected {unexpected}")
    draft.to(target.device).eval()
    return LoadedModel(name or directory.name, draft, target.tokenizer, "fp32", target.device)
