"""The word-level tokenizer: built from questions, written as JSON and read back."""

from vlfuse.encoders import build_word_tokenizer, word_tokenizer_from_json

QUESTIONS = ["what colour is the circle?", "Is there a red square?", "what shape is it?"]


def test_a_word_tokenizer_read_back_from_its_json_gives_the_same_ids_and_special_tokens():
    built = build_word_tokenizer(QUESTIONS, 12)
    read = word_tokenizer_from_json(built.backend_tokenizer.to_str(), 12)
    assert read.get_vocab() == built.get_vocab()
    assert read(QUESTIONS)["input_ids"] == built(QUESTIONS)["input_ids"]
    assert read("what is blue?")["input_ids"][1:-1] == [built.vocab["what"], built.vocab["is"], built.unk_token_id, built.vocab["?"]]
    for token in ("pad_token_id", "unk_token_id", "cls_token_id", "sep_token_id", "model_max_length"):
        assert getattr(read, token) == getattr(built, token), token
