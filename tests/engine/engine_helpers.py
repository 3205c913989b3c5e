"""Helpers of the engine tests: a tiny random Llama with a real tokenizer, random batches."""
from __future__ import annotations


VOCAB = 256


def make_tiny_llama(path: str, *, vocab: int = VOCAB, tie: bool = False, seed: int = 0) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    _save_word_tokenizer(path, vocab)
    return path


def _save_word_tokenizer(path: str, vocab: int) -> None:
    """A real (word-level) fast tokenizer so exported dirs can be checked for it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    words.update({f"w{i}": i for i in range(4, vocab)})
    tok = Tokenizer(WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(path)



def make_batch(lengths: list[int], prompt_len: int = 3, seed: int = 0, vocab: int = VOCAB):
    """Trajectories with random tokens: the first ``prompt_len`` tokens are
    prompt (the rank-engine suites' batch maker, with this module's vocabulary)."""
    from areal_kernel.testing.rank_engines import random_batch

    return random_batch(lengths, seed=seed, prompt_len=prompt_len, vocab=vocab)
