"""Build a tiny random Llama that the vLLM CPU build can serve.

Usage: python make_tiny_model.py OUTDIR

Run it with the python of the vLLM virtualenv (it needs torch, transformers and
tokenizers). It never touches the network: the tokenizer is trained in-process
on a few sentences and the weights are random (fixed seed).

Recipe and facts: docs/vllm.md. head_dim must be 64:
head_dim 16 is rejected by the CPU attention backend ("Unsupported CPU
attention configuration").

The conftest caches the output keyed by a hash of this file: edit it and the
model is rebuilt.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

VOCAB_SIZE = 512

SENTENCES = [
    "xpuctl launches vLLM on Intel GPUs under supervision.",
    "It drains the server, stops it and proves the GPU was released.",
    "A killed API server leaves EngineCore and its workers behind as orphans.",
    "Stale shared memory segments and socket files are cleaned before the next launch.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "One two three four five six seven eight nine ten.",
    "The user asks a question and the assistant answers it politely.",
    "Tiny models are random, so their answers make no sense at all.",
    "Pack my box with five dozen liquor jugs.",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 256
    return fast


def build_model(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=max(VOCAB_SIZE, len(tokenizer)),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.eval()
    return model


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out = argv[1]
    os.makedirs(out, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(
        f"tiny llama written to {out}: vocab {model.config.vocab_size}, "
        f"tokenizer {len(tokenizer)} tokens, "
        f"{sum(p.numel() for p in model.parameters())} parameters"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
