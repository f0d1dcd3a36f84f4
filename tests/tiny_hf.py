"""A tiny random Hugging Face model folder, saved by transformers itself (what a user's
``save_pretrained`` or a download holds): ``python tests/tiny_hf.py FAMILY OUT CORPUS`` trains
a byte-level BPE of 300 tokens on CORPUS, wraps it as transformers' fast tokenizer, and saves
both with a random FAMILY model (qwen2, llama, mistral: window 32, gemma) of that vocabulary,
in DTYPE (a 4th argument: float32, bfloat16); qwen2's tokenizer
has Qwen2.5's turn tokens and a chat template of its form (no tools). The docs' fine-tune
walkthroughs run on it (tests/test_docs.py); nothing is downloaded."""
import sys

QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]"
    "['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.role "
    "== 'system' and loop.first %}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if "
    "add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def main(family: str, out: str, corpus: str, dtype: str = "float32") -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([corpus], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    if family == "qwen2":                 # Qwen2.5's turn tokens and (short) chat template
        fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        fast.eos_token = "<|im_end|>"
        fast.chat_template = QWEN_TEMPLATE
    classes = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "llama": ("LlamaConfig", "LlamaForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM"),
               "gemma": ("GemmaConfig", "GemmaForCausalLM")}[family]
    torch.manual_seed(0)
    window = {"sliding_window": 32} if family == "mistral" else {}
    config = getattr(transformers, classes[0])(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=True, head_dim=16, **window)
    model = getattr(transformers, classes[1])(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
