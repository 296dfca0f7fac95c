"""A tiny randomly initialised BERT and a WordPiece tokenizer built in code: no files, no downloads."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

WORDS = [
    "hello",
    "hi",
    "hey",
    "how",
    "are",
    "you",
    "doing",
    "today",
    "good",
    "fine",
    "great",
    "thanks",
    "thank",
    "what",
    "is",
    "your",
    "name",
    "my",
    "favorite",
    "food",
    "pizza",
    "pasta",
    "music",
    "movie",
    "book",
    "i",
    "like",
    "love",
    "hate",
    "do",
    "not",
    "know",
    "yes",
    "no",
    "maybe",
    "sure",
    "weather",
    "sunny",
    "rain",
    "cold",
    "hot",
    "where",
    "from",
    "live",
    "city",
    "work",
    "school",
    "study",
    "play",
    "game",
    "sport",
    "football",
    "tennis",
    "dog",
    "cat",
    "pet",
    "family",
    "friend",
    "weekend",
    "plan",
    "travel",
    "trip",
    "beach",
    "mountain",
    "morning",
    "night",
    "sleep",
    "tired",
    "happy",
    "sad",
    "okay",
    "cool",
    "nice",
    "see",
    "bye",
    "later",
    "tomorrow",
    "?",
    "!",
    ".",
    ",",
    "'",
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
        f"##{chr(c)}" for c in range(ord("a"), ord("z") + 1)
    ]
    vocab = {
        tok: i
        for i, tok in enumerate(dict.fromkeys(specials + WORDS + letters + [str(d) for d in range(10)]))
    }
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def write_tiny_model(path: Path, seed: int = 0) -> Path:
    """Save a 2-layer, 32-wide BERT and its tokenizer as a local Hugging Face model directory."""
    import torch

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        type_vocab_size=2,
    )
    BertModel(config, add_pooling_layer=False).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
