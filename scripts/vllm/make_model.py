"""Builds the model the real-vLLM suite serves: a Llama of two small layers with random weights
around the router's bundled tokenizer (DeepSeek-V3's) and a chat template written over several
lines (rendered with Hugging Face's Jinja settings on both sides). Nothing is downloaded.

    python make_model.py TOKENIZER_JSON OUT_DIR
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# ChatML written over several lines without whitespace control: with `trim_blocks` and
# `lstrip_blocks` (Hugging Face's settings) it renders
# "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"; without them it would not.
CHAT_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'system' %}
<|im_start|>system
{{ message['content'] }}<|im_end|>
    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def main() -> None:
    tokenizer_json, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = json.loads(tokenizer_json.read_text())
    ids = list(tokenizer["model"]["vocab"].values()) + [t["id"] for t in tokenizer["added_tokens"]]
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    config = LlamaConfig(
        vocab_size=max(ids) + 1,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        bos_token_id=added[bos],
        eos_token_id=added[eos],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    shutil.copy(tokenizer_json, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": bos,
                "eos_token": eos,
                "model_max_length": 8192,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    print(out)


if __name__ == "__main__":
    main()
