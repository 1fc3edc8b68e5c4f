"""A chat model for the post-training examples that needs no download: a byte-level
tokenizer with a ChatML-like template, and the small Llama of ``train.py`` sized to it."""

from transformers import PreTrainedTokenizerFast

from train import small_byte_llama


def byte_chat_tokenizer():
    """A byte-level tokenizer (256 byte tokens and three specials) with a ChatML-like template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        additional_special_tokens=specials[1:])
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}")
    return tokenizer


def small_chat_llama(tokenizer):
    """``train.small_byte_llama`` with the tokenizer's vocabulary and end-of-sequence token."""
    model = small_byte_llama(vocab_size=len(tokenizer))
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
